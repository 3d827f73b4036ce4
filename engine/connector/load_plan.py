"""What a consumer reads from a producer's lease: the plan made when blocks are allocated,
and, once the producer has opened the lease, which block positions its hashes prove and
which block pairs the READ moves. Pure bookkeeping: no I/O, no NIXL."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Optional

from pdpool.engine.connector.lease_token import LeaseToken

# Per transport region, the (local, remote) unit ids a READ moves.
ReadUnits = dict[str, tuple[list[int], list[int]]]


@dataclass
class LoadPlan:
    request_id: str
    host: str
    port: int
    token: LeaseToken  # the lease named by the params (checked on admission)
    local_tables: list[list[int]]  # per KV group, the blocks at the pulled positions
    first_position: int  # block position of local_tables[g][0]
    own_hashes: list[bytes]  # our chained hashes of the prompt (for the content check)
    own_prefix_hash: Optional[bytes]  # ours at the lease's token count, if the prompt reaches
    num_external: int  # tokens the plan would bring
    wants_state: bool = False
    opening: Optional[Future] = None
    transfer_id: Optional[int] = None
    num_valid_positions: int = 0
    state_pair: Optional[tuple[int, Any]] = None  # (local running slot, remote state slot)
    # A peer's snapshot at the last block boundary before the pulled state, copied into a
    # local snapshot slot and published under that block's hash once it has arrived, so a
    # later turn can hit this prefix here: (local slot, remote slot, block hash).
    boundary_snapshot: Optional[tuple[int, Any, bytes]] = None
    # The request was aborted mid-READ: its blocks stay allocated until the READ ends.
    aborted: bool = False

    @property
    def read_id(self) -> int:
        """The READ's transfer id (plans being read always have one)."""
        if self.transfer_id is None:
            raise RuntimeError(f"load for {self.request_id} has no READ")
        return self.transfer_id

    @property
    def num_positions(self) -> int:
        return len(self.local_tables[0]) if self.local_tables else 0


def state_slots_of(value: Any, num_groups: int) -> Optional[list]:
    """The state slots a description carries after the attention groups' lists: the state
    at the end of the described tokens, then optionally the snapshot at the last block
    boundary before it."""
    if (
        isinstance(value, list)
        and len(value) == num_groups + 1
        and isinstance(value[num_groups], list)
        and 1 <= len(value[num_groups]) <= 2
    ):
        return value[num_groups]
    return None


def verified_positions(
    first: int,
    last: int,
    consumer_end: int,
    lease: dict,
    own_hashes: list[bytes],
    own_prefix_hash: Optional[bytes],
    block_size: int,
) -> int:
    """How many block positions from `first` (up to `last`) the consumer may load: each must
    hold, on the producer, exactly the tokens the consumer would compute there, which the
    chained hashes prove (a full block by its hash, the lease's final partial block by the
    hash of the whole leased prefix). Counting stops at the first block that fails."""
    num_tokens = int(lease["num_tokens"])
    hashes = lease["hashes"]
    tail = lease.get("tail_hash")
    n = 0
    for p in range(first, last):
        used_end = min((p + 1) * block_size, consumer_end)  # tokens we take from block p
        if used_end > num_tokens:
            break  # the producer does not hold all of them
        if (p + 1) * block_size <= num_tokens:
            ok = p < len(hashes) and p < len(own_hashes) and hashes[p] == own_hashes[p].hex()
        else:
            ok = tail is not None and own_prefix_hash is not None and tail == own_prefix_hash.hex()
        if not ok:
            break
        n += 1
    return n


def _usable_positions(remote_tables: list[list], first: int, valid: int, remote_units: int) -> int:
    """How many of the first `valid` positions every remote table names a block for that
    exists on the producer (a bad id cuts the plan there)."""
    for remote in remote_tables:
        for k in range(valid):
            rid = remote[first + k] if first + k < len(remote) else None
            if isinstance(rid, bool) or not isinstance(rid, int) or not 0 <= rid < remote_units:
                valid = k
                break
    return valid


def _block_pairs(
    local_tables: list[list[int]],
    remote_tables: list[list[int]],
    first: int,
    valid: int,
    sliding: list[bool],
) -> tuple[list[int], list[int]]:
    """(local ids, remote ids) to READ, group by group, for the first `valid` positions;
    a sliding-window group skips its null blocks (outside the window) on either side."""
    local_ids, remote_ids = [], []
    for g, (local, remote) in enumerate(zip(local_tables, remote_tables, strict=True)):
        for k in range(min(valid, len(local))):
            if sliding[g] and (remote[first + k] == 0 or local[k] == 0):
                continue
            local_ids.append(local[k])
            remote_ids.append(remote[first + k])
    return local_ids, remote_ids


def plan_read(
    plan: LoadPlan, lease: dict, remote_units: int, sliding: list[bool], block_size: int
) -> tuple[ReadUnits, bool]:
    """The units to READ for `plan` from the producer's opened `lease` (its answer to the
    open: block ids, hashes, state slots), and whether the content check cut the plan short.
    Sets `plan.num_valid_positions` and fills in the remote state slots. Raises KeyError,
    TypeError or ValueError on a malformed lease."""
    num_positions = plan.num_positions
    first, last = plan.first_position, plan.first_position + num_positions
    consumer_end = plan.first_position * block_size + plan.num_external
    remote_tables = [list(t) for t in lease["block_ids"]]
    slots = list(lease.get("state_slots") or [])
    valid = verified_positions(
        first, last, consumer_end, lease, plan.own_hashes, plan.own_prefix_hash, block_size
    )
    cut_by_content = valid < num_positions
    if len(remote_tables) < len(plan.local_tables):
        raise ValueError(
            f"the lease has {len(remote_tables)} block tables for {len(plan.local_tables)} groups"
        )
    remote_tables = remote_tables[: len(plan.local_tables)]
    valid = _usable_positions(remote_tables, first, valid, remote_units)
    if plan.wants_state:
        # A state resumes exactly where it was taken: all blocks up to there, or nothing.
        whole = consumer_end == lease.get("state_tokens") and valid == num_positions
        if not slots or not whole:
            valid = 0
    plan.num_valid_positions = valid
    units: ReadUnits = {"kv": _block_pairs(plan.local_tables, remote_tables, first, valid, sliding)}
    if plan.state_pair is not None and valid:
        plan.state_pair = (plan.state_pair[0], slots[0])
        units["state"] = ([plan.state_pair[0]], [slots[0]])
        if plan.boundary_snapshot is not None and len(slots) == 2:
            local_slot, _, block_hash = plan.boundary_snapshot
            plan.boundary_snapshot = (local_slot, slots[1], block_hash)
            units["state"][0].append(local_slot)
            units["state"][1].append(slots[1])
    return units, cut_by_content
