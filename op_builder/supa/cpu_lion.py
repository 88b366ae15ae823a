"""CPULionBuilder: DeepSpeed's host Lion (DeepSpeedCPULion), compiled from DeepSpeed's C++ sources."""

from . import builder


class CPULionBuilder(builder.SUPAOpBuilder):
    BUILD_VAR = "DS_BUILD_CPU_LION"
    NAME = "cpu_lion"

    def absolute_name(self):
        return f'deepspeed.ops.lion.{self.NAME}_op'

    def sources(self):
        return ['csrc/lion/cpu_lion.cpp', 'csrc/lion/cpu_lion_impl.cpp']

    def include_paths(self):
        return ['csrc/includes']
