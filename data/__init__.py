"""Dataset preparation (Hugging Face datasets -> token memmaps) and batch sampling."""

from data.prepare import PreparedData, prepare_data
from data.sampler import BatchSampler

__all__ = ["BatchSampler", "PreparedData", "prepare_data"]
