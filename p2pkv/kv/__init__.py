"""A KV cache's geometry and the planes that move it. Geometry (`layout`, `blocks`, `slices`, `tp`, `stages`): which
bytes of vLLM's cache make up a block, a head slice, a pipeline stage's layers, on either peer. Planes (`staging`,
`ipc` for cuda_ipc, `pipes`, `nccl`, `device_copy`): how those bytes move between GPU memory, pinned host memory and
peers."""
