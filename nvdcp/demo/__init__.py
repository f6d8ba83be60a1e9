"""The demo training job: a byte-level GPT trained with FSDP2, checkpointed with nvdcp."""
