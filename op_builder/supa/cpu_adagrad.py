"""CPUAdagradBuilder: DeepSpeed's host Adagrad (DeepSpeedCPUAdagrad), compiled from DeepSpeed's C++ sources."""

from . import builder


class CPUAdagradBuilder(builder.SUPAOpBuilder):
    BUILD_VAR = "DS_BUILD_CPU_ADAGRAD"
    NAME = "cpu_adagrad"

    def absolute_name(self):
        return f'deepspeed.ops.adagrad.{self.NAME}_op'

    def sources(self):
        return ['csrc/adagrad/cpu_adagrad.cpp']

    def include_paths(self):
        return ['csrc/includes']
