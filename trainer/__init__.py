"""FlashREINFORCE training: the objective (:mod:`.loss`), memory-lean log-probs (:mod:`.logprobs`), batching
(:mod:`.batch`), lr schedules (:mod:`.schedule`), checkpoints (:mod:`.checkpoint`) and the :class:`Learner`."""

from .batch import Batch, collate, microbatches
from .learner import Learner, LearnerConfig, trajectory_key
from .logprobs import chunked_log_probs, naive_log_probs, token_log_probs
from .loss import FullBatch, flashreinforce_loss, group_advantages, grpo_loss, sequence_kl, top_entropy_mask
from .schedule import Schedule, constant, cosine_with_min_lr

__all__ = [
    "Batch", "collate", "microbatches",
    "Learner", "LearnerConfig", "trajectory_key",
    "chunked_log_probs", "naive_log_probs", "token_log_probs",
    "FullBatch", "flashreinforce_loss", "group_advantages", "grpo_loss", "sequence_kl", "top_entropy_mask",
    "Schedule", "constant", "cosine_with_min_lr",
]
