"""Guided output is UTF-8, whatever the grammar.

xgrammar 0.2.8 (vLLM 0.32's) decodes bytes leniently: ED A0 80 (U+D800, a UTF-16
surrogate, written as if UTF-8, which forbids it) passes for one character of any rule whose
range spans it, such as a JSON-schema pattern's `.` (`[\\0-\\U0010ffff]`) or `[^a]`. The text
then holds three U+FFFD where the grammar counted one character, and `^.{1,10}$` fails.
json_grammar.py keeps surrogates out of the string rules it writes; a pattern's regex is
xgrammar's own. So after the grammar's mask this guard masks every token whose bytes would
not continue the output as UTF-8 (Unicode's table 3-7: no surrogates, overlong forms,
stray continuation bytes or code points past U+10FFFF), from the state the output's bytes
so far left: a character begun or not. A valid continuation of a begun character always
exists, and the grammar, which reads code points, allows some, so no row loses every token.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

# A state: START (between characters), or the range the next byte must be in and how many
# continuation bytes (80-BF) follow it.
START = 0
_STATES: list[Optional[tuple[int, int, int]]] = [
    None,
    (0x80, 0xBF, 0),
    (0x80, 0xBF, 1),
    (0x80, 0xBF, 2),
    (0xA0, 0xBF, 1),  # after E0: no overlong form
    (0x80, 0x9F, 1),  # after ED: no surrogate
    (0x90, 0xBF, 2),  # after F0: no overlong form
    (0x80, 0x8F, 2),  # after F4: nothing past U+10FFFF
]
_INDEX = {s: i for i, s in enumerate(_STATES)}
INVALID = -1
FEW = 4096  # up to this many ids to mask: an index list, more: a bool row


def _after_lead(byte: int) -> int:
    """The state after a first byte; INVALID if it cannot begin a character."""
    if byte < 0x80:
        return START
    if 0xC2 <= byte <= 0xDF:
        return _INDEX[(0x80, 0xBF, 0)]
    if byte == 0xE0:
        return _INDEX[(0xA0, 0xBF, 1)]
    if byte == 0xED:
        return _INDEX[(0x80, 0x9F, 1)]
    if 0xE1 <= byte <= 0xEF:
        return _INDEX[(0x80, 0xBF, 1)]
    if byte == 0xF0:
        return _INDEX[(0x90, 0xBF, 2)]
    if byte == 0xF4:
        return _INDEX[(0x80, 0x8F, 2)]
    if 0xF1 <= byte <= 0xF3:
        return _INDEX[(0x80, 0xBF, 2)]
    return INVALID


def advance(state: int, data: bytes) -> int:
    """The state after `data` from `state`; INVALID when the bytes are not UTF-8."""
    for byte in data:
        expect = _STATES[state]
        if expect is None:
            state = _after_lead(byte)
        elif expect[0] <= byte <= expect[1]:
            state = _INDEX[(0x80, 0xBF, expect[2] - 1)] if expect[2] else START
        else:
            return INVALID
        if state == INVALID:
            return INVALID
    return state


class Utf8Guard:
    """Each token's state transitions, from its bytes; the ids each state forbids."""

    def __init__(self, decoded_vocab: Sequence[bytes], vocab_size: int) -> None:
        vocab = list(decoded_vocab)[:vocab_size]
        n = len(_STATES)
        # Most tokens are whole characters: from START to START, and from inside a
        # character (which needs a continuation byte first) nowhere.
        self._next: list[dict[int, int]] = [{} for _ in range(n)]  # state -> {token: state}
        forbidden: list[list[int]] = [[] for _ in range(n)]
        for token, data in enumerate(vocab):
            if _decodes(data):
                for state in range(1, n):
                    forbidden[state].append(token)
                continue
            for state in range(n):
                after = advance(state, data)
                if after == INVALID:
                    forbidden[state].append(token)
                elif after != START or state != START:
                    self._next[state][token] = after
        self._forbidden = forbidden
        self._masks: dict[tuple[torch.device, int, int], Optional[torch.Tensor]] = {}

    def next_state(self, state: int, token: int) -> int:
        """The state after `token` (one the mask allowed) from `state`."""
        return self._next[state].get(token, START)

    def forbidden(self, state: int, width: int, device: torch.device) -> Optional[torch.Tensor]:
        """The ids to mask in `state` for logits `width` wide (None: none): an index list
        when few (between characters), else a bool row (inside a character nearly every
        token is masked: a bool row costs the same whatever the count)."""
        key = (device, state, width)
        if key not in self._masks:
            ids = [i for i in self._forbidden[state] if i < width]
            mask: Optional[torch.Tensor] = None
            if len(ids) > FEW:
                mask = torch.zeros(width, dtype=torch.bool)
                mask[ids] = True
                mask = mask.to(device)
            elif ids:
                mask = torch.tensor(ids, dtype=torch.long, device=device)
            self._masks[key] = mask
        return self._masks[key]

    def mask(self, logits: torch.Tensor, row: int, state: int) -> None:
        """Masks, in place, the row's tokens that would break UTF-8 from `state`."""
        forbidden = self.forbidden(state, logits.shape[-1], logits.device)
        if forbidden is None:
            return
        if forbidden.dtype == torch.bool:
            logits[row].masked_fill_(forbidden, float("-inf"))
        else:
            logits[row].index_fill_(0, forbidden, float("-inf"))


def _decodes(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return bool(data)
