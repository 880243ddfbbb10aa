"""One optimizer step's parts around the loop: DDP/FSDP/compile preparation, micro-batches, guards,
gradient flow, throughput and profiling."""
