"""SpatialInferenceBuilder: DeepSpeed's NHWC bias-add ops (diffusers inference) as torch_supa_ext operators."""

from . import builder


class SpatialInferenceBuilder(builder.SUPAExtensionOpBuilder):
    BUILD_VAR = "DS_BUILD_SPATIAL_INFERENCE"
    NAME = "spatial_inference"
    OPS = {name: name for name in ('nhwc_bias_add', 'nhwc_bias_add_add', 'nhwc_bias_add_bias_add')}

    def absolute_name(self):
        return f'deepspeed.ops.spatial.{self.NAME}_op'
