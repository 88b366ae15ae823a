"""DeepSpeed op builders for Biren SUPA devices.

Each builder answers DeepSpeed's two questions honestly: `is_compatible()` (probed, never
assumed) and `load()`. DeepSpeed finds them by scanning this package's modules for classes whose
names end in `Builder`; `builder.py` holds only the shared base.
"""

# Import DeepSpeed before any builder module: importing DeepSpeed can make the SUPA accelerator
# scan this package, and that scan needs DeepSpeed's OpBuilder base loaded before builder.py runs.
# Imported first from here, DeepSpeed completes its scan while this package is still empty.
import deepspeed.ops.op_builder.builder  # noqa: F401,E402

from .async_io import AsyncIOBuilder
from .cpu_adagrad import CPUAdagradBuilder
from .cpu_adam import CPUAdamBuilder
from .cpu_lion import CPULionBuilder
from .fused_adam import FusedAdamBuilder
from .fused_lamb import FusedLambBuilder
from .fused_lion import FusedLionBuilder
from .inference import InferenceBuilder
from .no_impl import (DeepCompileBuilder, EvoformerAttnBuilder, FPQuantizerBuilder, GDSBuilder,
                      InferenceCoreBuilder, InferenceCutlassBuilder, NotImplementedBuilder, RaggedOpsBuilder,
                      RaggedUtilsBuilder, RandomLTDBuilder, StochasticTransformerBuilder,
                      TransformerBuilder, UtilsBuilder)
from .pin_memory import PinMemoryBuilder
from .quantizer import QuantizerBuilder
from .spatial_inference import SpatialInferenceBuilder
