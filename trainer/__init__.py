"""FlashREINFORCE training: the objective (:mod:`.objectives`), memory-lean log-probs (:mod:`.logprobs`), batching
(:mod:`.batch`), lr schedules (:mod:`.schedule`), checkpoints (:mod:`.checkpoint`), the loss registry
(:mod:`.losses`), model files (:mod:`.model_io`), the :class:`Learner` and its sharded form (:mod:`.distributed`)."""

from .batch import Batch, collate, microbatches
from .learner import Learner, LearnerConfig, learner_config_from, trajectory_key
from .logprobs import FinalLogits, TokenLogProbs, chunked_log_probs, final_logits_of, naive_log_probs, token_log_probs
from .losses import LOSSES, LossInputs, LossResult, get_loss, register_loss
from .objectives import FullBatch, flashreinforce_loss, group_advantages, grpo_loss, sequence_kl, top_entropy_mask
from .schedule import Schedule, constant, cosine_with_min_lr

__all__ = [
    "Batch", "collate", "microbatches",
    "Learner", "LearnerConfig", "learner_config_from", "trajectory_key",
    "FinalLogits", "TokenLogProbs", "chunked_log_probs", "final_logits_of", "naive_log_probs", "token_log_probs",
    "LOSSES", "LossInputs", "LossResult", "get_loss", "register_loss",
    "FullBatch", "flashreinforce_loss", "group_advantages", "grpo_loss", "sequence_kl", "top_entropy_mask",
    "Schedule", "constant", "cosine_with_min_lr",
]
