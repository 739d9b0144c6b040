"""Whether a transfer's KV is pushed by the prefill side or pulled by the decode side, decided in one place.

Each part asks at the moment it learns an input: the prefill scheduler (send types, the decode KV address, parallel
sizes), the decode scheduler (the prefill answer's mode, sizes), the prefill worker at a transfer's first layer (the
link asked for pulls over a device path; pinned memory to stage the push), and the decode worker when a push was
refused (no staging space, other heads or layers). Inputs a part does not know yet keep their default, which never
asks for a pull on its own.
"""

from __future__ import annotations

import enum
from typing import NamedTuple


class Way(enum.Enum):
    PUSH = "push"
    PULL = "pull"


class WhyPull(enum.Enum):
    """Why a transfer is pulled instead of pushed. The values are what logs, metrics and a push's refusal say."""

    SIZES_DIFFER = ("the peers' tensor- or pipeline-parallel sizes differ: each decode rank pulls its heads and "
                    "layers")
    GET = "send_type GET: the decode side pulls"
    NO_ADDRESS = "no KV address of the decode side to push to"
    DEVICE_PATH = "the receiver pulls over a device path (cuda_ipc or a pipe): the sender holds the blocks for it"
    NO_PINNED = "no free pinned memory to stage the push"
    NO_SPACE = "no staging space (kv_buffer_size and the host pool are full)"
    HEADS_DIFFER = ("the sender holds other KV heads or layers (another tensor-parallel or pipeline-parallel size): "
                    "pull them by slices")

    @classmethod
    def of(cls, reason: str) -> WhyPull | None:
        """The reason a refusal gave, if it asks for a pull (a refusal that does not fails the transfer)."""
        return next((why for why in cls if why.value == reason), None)


class Decision(NamedTuple):
    way: Way
    why: WhyPull | None  # None: pushed

    @property
    def pulled(self) -> bool:
        return self.way is Way.PULL


def push_or_pull(*, sizes_differ: bool = False, decode_pulls: bool = False, decode_kv_known: bool = True,
                 device_path: bool = False, pinned_space: bool = True, refused: WhyPull | None = None) -> Decision:
    """Pulled when any input asks for it, for the first reason in this order:

    - `sizes_differ`: another tensor- or pipeline-parallel size on the other side (whole blocks pushed rank to rank
      would carry the wrong heads or layers);
    - `decode_pulls`: `send_type` GET on either side, or the prefill answer says the transfer is held for a pull;
    - not `decode_kv_known`: the prefill side has nowhere to push;
    - `device_path`: the decode worker asked at the handshake to pull over a device path;
    - not `pinned_space`: no page-locked memory to stage the push from a GPU cache;
    - `refused`: the decode side refused the push for this reason.
    """
    if sizes_differ:
        return Decision(Way.PULL, WhyPull.SIZES_DIFFER)
    if decode_pulls:
        return Decision(Way.PULL, WhyPull.GET)
    if not decode_kv_known:
        return Decision(Way.PULL, WhyPull.NO_ADDRESS)
    if device_path:
        return Decision(Way.PULL, WhyPull.DEVICE_PATH)
    if not pinned_space:
        return Decision(Way.PULL, WhyPull.NO_PINNED)
    if refused is not None:
        return Decision(Way.PULL, refused)
    return Decision(Way.PUSH, None)
