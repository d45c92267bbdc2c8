"""Arrays of strings read from a file, kept as its bytes: the loader makes them, the tokenizer reads them (numpy only)."""

import operator
from collections.abc import Iterator, Sequence

import numpy as np


class StringArray(Sequence):
    """A GGUF array of strings as one copy of the file's bytes for it and each item's start, every item's UTF-8
    checked while parsing and decoded again when read. Qwen3.5's vocabulary and merges as lists of str were 93 MB
    of Python objects that a checkpoint held while its weights loaded (the tokenizer copies them into tables of its
    own); as this, 16 MB. Equal to a list of the same strings."""

    __slots__ = ("_data", "_starts")

    def __init__(self, data: bytes, starts: np.ndarray):
        self._data, self._starts = data, starts  # item i: data[starts[i]:starts[i + 1] - 8], each after its length

    def __len__(self) -> int:
        return len(self._starts)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = operator.index(i)
        i += len(self) if i < 0 else 0
        if not 0 <= i < len(self):
            raise IndexError(f"index {i} out of range for {len(self)} strings")
        end = int(self._starts[i + 1]) - 8 if i + 1 < len(self) else len(self._data)
        return str(self._data[int(self._starts[i]):end], "utf-8")

    def __iter__(self) -> Iterator[str]:
        data, starts = self._data, self._starts.tolist() + [len(self._data) + 8]
        return (str(data[a:b - 8], "utf-8") for a, b in zip(starts, starts[1:]))

    def spans(self) -> tuple[bytes, np.ndarray, np.ndarray]:
        """The bytes holding every item, and where each item's UTF-8 starts and ends in them (int64)."""
        ends = np.append(self._starts[1:] - 8, len(self._data)).astype(np.int64)
        return self._data, self._starts.astype(np.int64), ends

    def __eq__(self, other) -> bool:
        if not isinstance(other, (list, tuple, StringArray)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None  # a list's equal

    def __repr__(self) -> str:
        head = ", ".join(repr(s) for s in self[:3])
        return f"StringArray([{head}{', ...' if len(self) > 3 else ''}], {len(self)} strings)"
