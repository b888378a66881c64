"""kfac_jax_dist: distributed K-FAC (and Shampoo) as pure optax transforms."""

from kfac_jax_dist.tools import checkpoint
from kfac_jax_dist.flax import intercept as _intercept  # registers capture="flax"
from kfac_jax_dist.flax import linen
from kfac_jax_dist.capture import losses
from kfac_jax_dist.flax import nnx
from kfac_jax_dist.capture import tags
from kfac_jax_dist.capture.tags import remat
from kfac_jax_dist.core import tensor_parallel
from kfac_jax_dist.capture.value_and_grad import value_and_grad
from kfac_jax_dist.capture.value_and_grad import ValueAndGrad
from kfac_jax_dist.tools.checkpoint import checkpoint_metadata
from kfac_jax_dist.tools.checkpoint import convert_state
from kfac_jax_dist.tools.checkpoint import restore_checkpoint
from kfac_jax_dist.tools.checkpoint import save_checkpoint
from kfac_jax_dist.tools.describe import describe
from kfac_jax_dist.core.distribution import Distribution
from kfac_jax_dist.kfac import cost as _cost  # registers Distribution.auto
from kfac_jax_dist.core.faults import skip_faulty_steps
from kfac_jax_dist.core.specs import partition_specs
from kfac_jax_dist.core.specs import init_sharded
from kfac_jax_dist.core.specs import shard_state
from kfac_jax_dist.kfac.state import find_states
from kfac_jax_dist.kfac.state import running_factors
from kfac_jax_dist.kfac.state import ScaleByKfacState
from kfac_jax_dist.kfac.state import second_order_parts
from kfac_jax_dist.kfac.optimizer import kfac
from kfac_jax_dist.kfac.adaptive import adapted_values
from kfac_jax_dist.kfac.transform import scale_by_kfac
from kfac_jax_dist.capture.registry import LayerRegistry
from kfac_jax_dist.capture.registry import TaggedLayer
from kfac_jax_dist.shampoo.transform import scale_by_shampoo
from kfac_jax_dist.shampoo.transform import shampoo
from kfac_jax_dist.shampoo.state import ScaleByShampooState
from kfac_jax_dist.shampoo.soap import ScaleBySoapState
from kfac_jax_dist.shampoo.soap import scale_by_soap
from kfac_jax_dist.shampoo.soap import soap
from kfac_jax_dist.core.tensor_parallel import model_shard
from kfac_jax_dist.core.tensor_parallel import ModelShardedState

__version__ = "0.1.0"

__all__ = [
    "adapted_values", "Distribution", "LayerRegistry", "ScaleByKfacState", "TaggedLayer", "ValueAndGrad",
    "ScaleByShampooState", "scale_by_shampoo", "shampoo",
    "ScaleBySoapState", "scale_by_soap", "soap",
    "checkpoint", "checkpoint_metadata", "convert_state", "restore_checkpoint",
    "save_checkpoint", "second_order_parts", "skip_faulty_steps",
    "describe", "find_states", "init_sharded", "kfac", "linen", "losses", "model_shard", "ModelShardedState", "nnx",
    "partition_specs", "remat", "running_factors", "scale_by_kfac", "shard_state", "tags",
    "tensor_parallel", "value_and_grad",
]
