"""The continuous-batching cache of the generate_batch tests: 64 pages of 16 tokens. Without a config transformers
sizes the paged cache from 60-80% of the free memory (transformers 5.25 on a 24 GiB CPU machine: a pytest process
of 14.7 GB, which an OOM killer took when another job shared the machine)."""


def small_cache():
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    return ContinuousBatchingConfig(block_size=16, num_blocks=64, max_batch_tokens=256)
