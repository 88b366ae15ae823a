"""CPUAdamBuilder: DeepSpeed's host Adam (DeepSpeedCPUAdam, ZeRO-Offload), compiled from DeepSpeed's C++ sources."""

from . import builder


class CPUAdamBuilder(builder.SUPAOpBuilder):
    BUILD_VAR = "DS_BUILD_CPU_ADAM"
    NAME = "cpu_adam"

    def absolute_name(self):
        return f'deepspeed.ops.adam.{self.NAME}_op'

    def sources(self):
        return ['csrc/adam/cpu_adam.cpp', 'csrc/adam/cpu_adam_impl.cpp']

    def include_paths(self):
        return ['csrc/includes']
