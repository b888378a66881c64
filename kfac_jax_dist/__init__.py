"""kfac_jax_dist: distributed K-FAC (and Shampoo) as pure optax transforms."""

from kfac_jax_dist import checkpoint
from kfac_jax_dist import linen
from kfac_jax_dist import losses
from kfac_jax_dist import nnx
from kfac_jax_dist import tags
from kfac_jax_dist import tensor_parallel
from kfac_jax_dist.capture import value_and_grad
from kfac_jax_dist.capture import ValueAndGrad
from kfac_jax_dist.checkpoint import checkpoint_metadata
from kfac_jax_dist.checkpoint import convert_state
from kfac_jax_dist.checkpoint import restore_checkpoint
from kfac_jax_dist.checkpoint import save_checkpoint
from kfac_jax_dist.describe import describe
from kfac_jax_dist.distributed import Distribution
from kfac_jax_dist.distributed import partition_specs
from kfac_jax_dist.distributed import shard_state
from kfac_jax_dist.kfac import find_states
from kfac_jax_dist.kfac import kfac
from kfac_jax_dist.kfac import running_factors
from kfac_jax_dist.kfac import scale_by_kfac
from kfac_jax_dist.kfac import second_order_parts
from kfac_jax_dist.kfac import ScaleByKfacState
from kfac_jax_dist.kfac import skip_faulty_steps
from kfac_jax_dist.registry import LayerRegistry
from kfac_jax_dist.registry import TaggedLayer
from kfac_jax_dist.shampoo import scale_by_shampoo
from kfac_jax_dist.shampoo import shampoo
from kfac_jax_dist.shampoo import ScaleByShampooState
from kfac_jax_dist.tensor_parallel import model_shard
from kfac_jax_dist.tensor_parallel import ModelShardedState

__version__ = "0.1.0"

__all__ = [
    "Distribution", "LayerRegistry", "ScaleByKfacState", "TaggedLayer", "ValueAndGrad",
    "ScaleByShampooState", "scale_by_shampoo", "shampoo",
    "checkpoint", "checkpoint_metadata", "convert_state", "restore_checkpoint",
    "save_checkpoint", "second_order_parts", "skip_faulty_steps",
    "describe", "find_states", "kfac", "linen", "losses", "model_shard", "ModelShardedState", "nnx",
    "partition_specs", "running_factors", "scale_by_kfac", "shard_state", "tags",
    "tensor_parallel", "value_and_grad",
]
