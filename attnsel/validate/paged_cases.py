"""Validation cases over the paged cache: decode (one query per sequence) and extend (ragged queries per sequence,
each sequence's last tokens, over its cached prefix: chunked prefill, prompt-cache hits, multi-token decode).

Both are built by ``inputs.paged``, so both carry the paged-cache traps (inputs.py); extend adds rows with no query,
fresh prompts (no prefix), prefixes ending mid-page and graph-padding rows (context 0) whose queries give zeros; q
has PAD_ROWS rows of NaN past the last offset (engines pad q under CUDA graphs; their output is not judged).
"""
from __future__ import annotations

import dataclasses

import torch

from ..spec import AttentionSpec
from .inputs import cumulative, paged, scale_tensors
from .yardstick import row_errors


@dataclasses.dataclass
class DecodeCase:
    page_table: torch.Tensor
    seq_lens: torch.Tensor
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    ref: torch.Tensor  # float32
    yard_err: torch.Tensor  # float32 [rows]
    sinks: torch.Tensor | None = None
    k_scale: torch.Tensor | None = None  # float32 [1] when spec.kv_dtype
    v_scale: torch.Tensor | None = None
    changed_inputs: list[str] = dataclasses.field(default_factory=list)
    rerun_diff: torch.Tensor | None = None
    layout_error: str | None = None  # set by run_case for a backend with decode_takes_b1hd

    INPUTS = ("page_table", "seq_lens", "q", "k_cache", "v_cache", "sinks", "k_scale", "v_scale")

    def plan(self, backend, spec: AttentionSpec):
        return backend.plan_decode(spec, self.page_table, self.seq_lens)

    def judged(self, out):
        """The rows of an output that are judged: all of them (one per sequence)."""
        return out

    def describe(self) -> str:
        return (f"decode seq_lens={self.seq_lens.tolist()} pages={self.k_cache.shape[0]} (shuffled; NaN/inf in "
                f"unused slots, -1/{self.k_cache.shape[0]} in unused page-table columns)")

    def sequence_of_row(self, row: int) -> str:
        return f"sequence {row} (seq_len {int(self.seq_lens[row])})"

    def row_label(self, row: int) -> str:
        n = int(self.seq_lens[row])
        where = f"its query at position {n - 1}" if n else "padding"
        return f"{self.sequence_of_row(row)}, {where} (row {row})"


PAD_ROWS = 3  # q rows past cu_seqlens_q[-1] in extend cases


@dataclasses.dataclass
class ExtendCase:
    cu_q: torch.Tensor  # int32 [batch + 1]
    page_table: torch.Tensor
    seq_lens: torch.Tensor  # each row's context, its queries included
    max_q: int
    max_len: int
    q: torch.Tensor  # [total_q, H, D]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    ref: torch.Tensor  # float32
    yard_err: torch.Tensor  # float32 [rows]
    sinks: torch.Tensor | None = None
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    changed_inputs: list[str] = dataclasses.field(default_factory=list)
    rerun_diff: torch.Tensor | None = None
    layout_error: str | None = None  # unused: extend has one layout

    INPUTS = ("cu_q", "page_table", "seq_lens", "q", "k_cache", "v_cache", "sinks", "k_scale", "v_scale")

    def plan(self, backend, spec: AttentionSpec):
        return backend.plan_extend(spec, self.cu_q, self.page_table, self.seq_lens, self.max_q, self.max_len)

    def judged(self, out):
        """The rows of an output that are judged: those of the queries (q's padding rows past the last offset are
        not)."""
        rows = self.ref.shape[0]
        return out[:rows] if isinstance(out, torch.Tensor) and out.dim() == 3 and out.shape[0] > rows else out

    def describe(self) -> str:
        lq = (self.cu_q[1:] - self.cu_q[:-1]).tolist()
        return (f"extend q_lens={lq} seq_lens={self.seq_lens.tolist()} pages={self.k_cache.shape[0]} (shuffled; "
                f"NaN/inf in unused slots, -1/{self.k_cache.shape[0]} in unused page-table columns)")

    def _row(self, row: int) -> tuple[int, int, int]:
        cq = self.cu_q.tolist()
        b = next(i for i in range(len(cq) - 1) if cq[i] <= row < cq[i + 1])
        return b, cq[b + 1] - cq[b], row - cq[b]

    def sequence_of_row(self, row: int) -> str:
        b, lq, _ = self._row(row)
        return f"sequence {b} (q_len {lq}, seq_len {int(self.seq_lens[b])})"

    def row_label(self, row: int) -> str:
        b, lq, i = self._row(row)
        pos = int(self.seq_lens[b]) - lq + i
        where = f"query {i} at position {pos}" if pos >= 0 else f"query {i}, padding (no key)"
        return f"{self.sequence_of_row(row)}, {where} (row {row})"


def decode_lengths(spec: AttentionSpec, device: torch.device) -> tuple[list[int], int]:
    """(context lengths with the new token, number of window-boundary sequences at the end): 1, a page and one, a
    zero-length row (CUDA-graph padding), partial pages, one long; with a sliding window w, boundary sequences of
    w - 1, w, w + 1 and well past w."""
    ps = spec.page_size
    long = 1531 if device.type == "cuda" else 157
    lens = [1, ps + 1, 0, max(2, 3 * ps - 5), long, 2 * ps]
    w = spec.sliding_window
    boundary = [n for n in (w - 1, w, w + 1, w + 2 * ps + 3) if n >= 1] if w is not None else []
    return lens + boundary, len(boundary)


def decode_case(spec: AttentionSpec, device: torch.device, seed: int = 1, lengths: list[int] | None = None
                ) -> DecodeCase:
    """The decode case with its traps (decode_lengths), or the given context lengths (same traps, no boundary)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    lens, boundary = decode_lengths(spec, device) if lengths is None else (list(lengths), 0)
    built = paged(spec, gen, lens, [1] * len(lens), boundary)
    to = dict(device=device)
    return DecodeCase(built.page_table.to(**to), torch.tensor(lens, dtype=torch.int32, **to), built.q.to(**to),
                      built.k_cache.to(**to), built.v_cache.to(**to), built.ref.to(**to),
                      row_errors(built.low, built.ref).to(**to),
                      built.sinks.to(**to) if built.sinks is not None else None, *scale_tensors(spec, device))


def extend_lengths(spec: AttentionSpec, device: torch.device) -> tuple[list[int], list[int], int]:
    """(query lengths, context lengths with the queries, number of window-boundary rows at the end): a fresh prompt
    (no prefix), a row with no query, multi-token decode (2 queries) crossing a page, graph padding (2 queries, no
    context: zeros), a prefix ending mid-page, a few-token prefix, a chunk over a long prefix; with a sliding window
    w, rows whose 3 queries straddle the window's reach (contexts w - 1, w + 1, w + 2 pages + 3)."""
    ps = spec.page_size
    if device.type == "cuda":
        q = [13, 0, 2, 2, 5, 97, 61]
        n = [13, 40, ps + 1, 0, 2 * ps + 3 + 5, 97 + 3, 1531]
    else:
        q = [7, 0, 2, 2, 5, 9, 11]
        n = [7, 9, ps + 1, 0, 2 * ps + 3 + 5, 9 + 3, 157]
    w = spec.sliding_window
    if w is None:
        return q, n, 0
    # boundary rows: 3 queries around the window's reach, and a chunk whose first half sees its whole prefix and whose
    # second half is cut by the window (chunk kernels take other paths than few-query rows)
    chunk = 61 if device.type == "cuda" else 11
    short = [m for m in (w - 1, w + 1, w + 2 * ps + 3) if m >= 3]
    return q + [3] * len(short) + [chunk], n + short + [w + chunk // 2], len(short) + 1


def extend_case(spec: AttentionSpec, device: torch.device, seed: int = 4,
                lengths: tuple[list[int], list[int]] | None = None) -> ExtendCase:
    """The extend case with its traps (extend_lengths), or the given (query lengths, context lengths)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    q_lens, lens, boundary = extend_lengths(spec, device) if lengths is None else (*map(list, lengths), 0)
    if len(q_lens) != len(lens):
        raise ValueError(f"extend_case: {len(q_lens)} query lengths for {len(lens)} context lengths")
    built = paged(spec, gen, lens, q_lens, boundary)
    to = dict(device=device)
    q = torch.cat([built.q, torch.full((PAD_ROWS, *built.q.shape[1:]), float("nan"), dtype=built.q.dtype)])
    seq_lens = torch.tensor(lens, dtype=torch.int32, **to)
    return ExtendCase(cumulative(q_lens, device), built.page_table.to(**to), seq_lens, max(q_lens, default=0),
                      max(lens, default=0), q.to(**to), built.k_cache.to(**to),
                      built.v_cache.to(**to), built.ref.to(**to), row_errors(built.low, built.ref).to(**to),
                      built.sinks.to(**to) if built.sinks is not None else None, *scale_tensors(spec, device))
