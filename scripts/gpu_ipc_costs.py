"""Where the time of a pull by reference over cuda_ipc goes: the GPU check's cuda_ipc row (`p2pkv.bench.ipc_check`)
with each part of one `copy_into` timed alone, on the same opened cache, per size: the runs of our blocks, the
copies queued, the wait, and a plain copy out of the peer's memory and out of our own. A diagnostic for a GPU
machine (it reads the opened cache's private fields on purpose); run with `python scripts/gpu_ipc_costs.py`."""

import cProfile
import pstats
import time


def main():
    import torch

    from p2pkv.bench import ipc_check
    from p2pkv.engine.device import pair_ranges
    from p2pkv.kv import ipc
    from p2pkv.kv.device_copy import settle

    prof = cProfile.Profile()
    orig = ipc_check._rate

    def timed(name, f, n=30):
        f()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            f()
        torch.cuda.synchronize()
        print(f"  {name:34s} {(time.perf_counter() - t) / n * 1e6:9.1f} us", flush=True)

    def rate(engine, peer, remote, cache, device, size, repeats):
        if remote is None:
            return orig(engine, peer, remote, cache, device, size, repeats)
        ids = list(range(size // ipc_check.BLOCK_BYTES))
        kv = remote._kv
        src = remote._storages[0]
        whole = ipc._whole(kv, [[(0, size)]], ids)
        cut = pair_ranges(whole[0][2], whole[0][3])
        print(f"{size >> 20} MiB: {len(cut)} pieces", flush=True)
        timed("copy_into", lambda: remote.copy_into([[(0, size)]], ids, time.monotonic() + 60))
        timed("_whole (local ranges)", lambda: ipc._whole(kv, [[(0, size)]], ids))
        timed("pair_ranges", lambda: pair_ranges(whole[0][2], whole[0][3]))
        timed("copy_pairs, no wait", lambda: kv.copy_pairs([(0, src, cut)]))
        timed("copy_pairs + settle", lambda: settle([kv.copy_pairs([(0, src, cut)])], time.monotonic() + 60, 5))
        timed("copy_pairs + synchronize", lambda: (kv.copy_pairs([(0, src, cut)]), torch.cuda.synchronize()))
        part = size // 32  # as 32 layers of a model would come: 32 pieces in one copy_runs
        layers = [(0, 0, [(i * part, part)], [(i * part, part)]) for i in range(32)]
        timed("copy_runs, 32 pieces as layers", lambda: remote.copy_runs(layers, time.monotonic() + 60))
        dst = kv.storages[0][:size]
        own = dst.clone()
        timed("plain copy + synchronize", lambda: (dst.copy_(src[:size]), torch.cuda.synchronize()))
        timed("plain copy", lambda: dst.copy_(src[:size]))
        timed("plain copy of our own memory", lambda: dst.copy_(own))
        prof.enable()
        for _ in range(20):
            remote.copy_into([[(0, size)]], ids, time.monotonic() + 60)
        prof.disable()
        return orig(engine, peer, remote, cache, device, size, repeats)

    ipc_check._rate = rate
    _, rates = ipc_check.run("cuda", [1 << 20, 64 << 20, 1 << 30])
    for r in rates:
        print(r, flush=True)
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
