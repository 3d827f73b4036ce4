"""vLLM's `bad_words`: words the output may not contain.

Each word becomes token sequences (`token_sequences`): its own tokens, and those of the
word after a space when that spelling is a different token sequence of the same length (a
word inside a sentence is usually one token with its space). At each step a sequence's last
token is banned when the output so far ends with the rest of it (`banned`): a one-token
word never appears; a longer one cannot be completed. Only the request's output counts, not
its prompt, as in vLLM.

Pure functions without torch: the HTTP process tokenizes the words, the sampler bans."""

from __future__ import annotations

from typing import Callable

from pdpool.protocol import MAX_BAD_WORD_CHARS

# Token sequences per request after tokenization (vLLM's VLLM_MAX_NUM_BAD_WORDS default).
MAX_BAD_WORD_SEQUENCES = 128
# A word of the longest length, each character up to four byte tokens, after a space.
MAX_BAD_WORD_TOKENS = 4 * MAX_BAD_WORD_CHARS + 1


def token_sequences(
    words: list[str], encode: Callable[[str], list[int]], vocab_size: int
) -> list[list[int]]:
    """The sequences `words` ban, as vLLM derives them; ValueError naming the problem (an
    empty word, one that tokenizes to nothing, too many sequences, an id outside the
    vocabulary)."""
    sequences: list[list[int]] = []
    for word in dict.fromkeys(words):  # a repeated word counts once
        if not word:
            raise ValueError("bad_words cannot contain an empty string")
        plain = encode(word.lstrip())
        if not plain:
            raise ValueError(f"bad_words entry {word[:40]!r} tokenizes to no token")
        sequences.append(plain)
        spaced = encode(" " + word.lstrip())
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
        if len(sequences) > MAX_BAD_WORD_SEQUENCES:
            raise ValueError(
                f"bad_words: at most {MAX_BAD_WORD_SEQUENCES} token sequences after "
                f"tokenization, got more than that"
            )
    outside = sorted({t for seq in sequences for t in seq if not 0 <= t < vocab_size})
    if outside:
        raise ValueError(f"bad_words tokenize to ids outside the vocabulary: {outside[:8]}")
    return sequences


def banned(sequences: list[list[int]], output_ids: list[int]) -> list[int]:
    """The tokens the next step may not sample: each sequence's last token where the output
    ends with the tokens before it."""
    out: list[int] = []
    for seq in sequences:
        before = len(seq) - 1
        if before == 0:
            out.append(seq[0])
        elif (
            before <= len(output_ids)
            and output_ids[-1] == seq[-2]  # the slice below is copied only when close
            and output_ids[-before:] == seq[:-1]
        ):
            out.append(seq[-1])
    return out
