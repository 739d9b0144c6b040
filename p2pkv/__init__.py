"""p2pkv: peer-to-peer KV cache transfer for disaggregated prefill/decode serving with vLLM."""

__version__ = "0.1.0"
# The control plane's version; peers of another version refuse each other at the hello. What each one changed:
#  1  the first: hello, pushes, acks, pulls, offers
#  2  frames of several whole layers (PushBlocks.layers)
#  3  cuda_ipc pulls by reference (Hello.device_kind, HelloReply.device, PullRequest/PullReply.by_reference)
#  4  nccl pipes (PipeOpen, PullRequest.pipe_runs, PullReply.by_pipe)
#  5  tensor-parallel sizes that differ: heads in the layout digest, pulls of head slices (PullRequest.heads)
#  6  pipeline parallelism: the layout digest names the first layer held
#  7  pushes over a device path become pulls (HelloReply.pull_instead, Hello.home, PullInstead)
#  8  payload digests (integrity_check)
#  9  digests of pulls copied cache to cache (BlockRanges.digest)
# 10  lease renewal for decode requests still waiting for blocks (RenewLeases)
# 11  whole vLLM blocks under kernel-block splits (LayoutDigest.kernel_blocks); BlockPlaces replaces BlockRanges,
#     PullRequest.by_pipe replaces pipe_runs, one export handle per storage
# 12  the layout digest names the physical order of a block (LayoutDigest.block_order) and the KV cache's quantized
#     format (the model factor kv_cache_dtype)
# 13  frames of a connection are signed under a per-connection key and a sequence number (Hello.nonce,
#     HelloReply.nonce and hello_nonce); HelloReply.idle_s
# 14  pushes say the digest of the prompt they were computed for (PushBlocks.prompt, PullInstead.prompt)
# 15  a layer may leave out blocks at its start, outside its sliding window (PushBlocks.skip)
PROTOCOL_VERSION = 16
