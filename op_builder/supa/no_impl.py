"""Builders for DeepSpeed ops that have no SUPA implementation: incompatible, and load() says so by name.

Each class carries DeepSpeed's class name and op name, so DeepSpeed's registry (ALL_OPS,
ds_report, `get_accelerator().create_op_builder(...)`) lists the op as present but not compatible,
and code that loads one anyway gets an error naming the op and the backend.
"""

from . import builder


class NotImplementedBuilder(builder.SUPAOpBuilder):
    BUILD_VAR = "DS_BUILD_NOT_IMPLEMENTED"
    NAME = "deepspeed_not_implemented"
    # Why the op is missing, appended to the error.
    REASON = "there is no SUPA kernel or host implementation for it"

    def absolute_name(self):
        return f'deepspeed.ops.{self.NAME}_op'

    def is_compatible(self, verbose=False):
        self.error_log = self._message()
        if verbose:
            self.warning(self.error_log)
        return False

    def _message(self):
        return (f"DeepSpeed op '{self.NAME}' ({type(self).__name__}) is not implemented for the SUPA backend: "
                f"{self.REASON}")

    def load(self, verbose=False):
        raise NotImplementedError(self._message())

    def jit_load(self, verbose=True):
        return self.load(verbose)


class DeepCompileBuilder(NotImplementedBuilder):
    NAME = "dc"
    REASON = "torch_supa_ext registers the dc:: ops only as stubs"


class EvoformerAttnBuilder(NotImplementedBuilder):
    NAME = "evoformer_attn"


class FPQuantizerBuilder(NotImplementedBuilder):
    NAME = "fp_quantizer"
    REASON = "torch_supa_ext registers fp_quantize/fp_dequantize only as stubs"


class GDSBuilder(NotImplementedBuilder):
    NAME = "gds"
    REASON = "GPUDirect Storage is NVIDIA-only"


class InferenceCoreBuilder(NotImplementedBuilder):
    NAME = "inference_core_ops"
    REASON = "the inference v2 kernels are stubs in torch_supa_ext"


class InferenceCutlassBuilder(NotImplementedBuilder):
    NAME = "cutlass_ops"
    REASON = "CUTLASS kernels are NVIDIA-only"


class RaggedOpsBuilder(NotImplementedBuilder):
    NAME = "ragged_device_ops"
    REASON = "the ragged inference v2 kernels are stubs in torch_supa_ext"


class RaggedUtilsBuilder(NotImplementedBuilder):
    NAME = "ragged_ops"
    REASON = "its fast host buffer needs a CUDA build"


class RandomLTDBuilder(NotImplementedBuilder):
    NAME = "random_ltd"
    REASON = "torch_supa_ext registers the token_* ops only as stubs"


class StochasticTransformerBuilder(NotImplementedBuilder):
    NAME = "stochastic_transformer"


class TransformerBuilder(NotImplementedBuilder):
    NAME = "transformer"
    REASON = "torch_supa_ext registers the transformer_* ops only as stubs"


class UtilsBuilder(NotImplementedBuilder):
    NAME = "utils"
    REASON = "the installed DeepSpeed does not ship its csrc/utils sources"
