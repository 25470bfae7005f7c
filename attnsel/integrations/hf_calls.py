"""The keyword arguments of transformers' attention calls (which attnsel serves, which leave the attention unchanged,
which hand the call back) and the count of the calls attnsel served and handed back."""
from __future__ import annotations

import logging

import torch

from .. import AttentionSpec

log = logging.getLogger(__name__)

# Served: become spec fields or run-time inputs.
SERVED = frozenset({"sliding_window", "softcap", "s_aux", "is_causal", "output_attentions"})
# Irrelevant: model arguments that do not change the attention's result (positions are applied to q/k before the
# call; packed sequences show in the mask, which is then 4D and handed back).
IRRELEVANT = frozenset({"position_ids", "use_cache", "output_router_logits", "output_hidden_states",
                        "num_items_in_batch", "return_dict"})
# generate()'s own objects. generate takes these for its decoding loop (GenerationMixin._extract_generation_mode_kwargs:
# a tokenizer for stop strings and token healing, a draft model and its tokenizer, a streamer, a flag) and calls the
# decoding method with them; the method's **model_kwargs carry those it does not name (the tokenizer, in sampling and
# beam search) into every forward, and the model's **kwargs carry them down to the attention call untouched (5.17 to
# 5.25). No model reads them and transformers' own attention functions ignore them. Only these names, and only with a
# value that is not a tensor (a tensor under such a name would be a model's own input): any other argument, known to
# no list here, still hands the call back.
GENERATE_ONLY = frozenset({"tokenizer", "assistant_tokenizer", "assistant_model", "streamer", "synced_gpus"})
# Continuous batching's plumbing, read by the paged path.
PAGED = frozenset({"cache", "cu_seq_lens_q", "cu_seq_lens_k", "max_seqlen_q", "max_seqlen_k", "read_index",
                   "write_index", "block_table", "logits_indices", "logits_processor_args"})
# Arguments transformers' sdpa_attention_forward honours (the rest it ignores: those calls go to the model's eager).
SDPA_HONOURS = frozenset({"is_causal", "position_bias", "sliding_window"}) | IRRELEVANT


def is_causal(module, kwargs: dict) -> bool:
    """The call's causality as transformers' attention functions read it: ``is_causal`` passed down, else the
    module's attribute (default causal)."""
    causal = kwargs.get("is_causal")
    return not (causal is False or (causal is None and getattr(module, "is_causal", True) is False))


def leaves_attention_unchanged(name: str, value) -> bool:
    """The argument cannot change the attention's result (not set, a model argument known not to, or one of
    generate's own objects)."""
    return (value is None or name in IRRELEVANT
            or (name in GENERATE_ONLY and not isinstance(value, torch.Tensor)))


def unimplemented(kwargs: dict, plumbing: frozenset = frozenset()) -> str | None:
    """The name of the first argument that may change the attention and that attnsel does not implement, or None."""
    for name, value in kwargs.items():
        if name not in SERVED and name not in plumbing and not leaves_attention_unchanged(name, value):
            return name
    return None


def sdpa_ignores(kwargs: dict) -> list[str]:
    """The arguments that may change the attention and that transformers' SDPA attention would ignore."""
    return [name for name, value in kwargs.items()
            if name not in SDPA_HONOURS and not leaves_attention_unchanged(name, value)
            and not (name == "output_attentions" and not value)]


def short(val) -> str:
    """An argument's value in a reason: a tensor's shape, else its repr cut to 40 characters."""
    if isinstance(val, torch.Tensor):
        return f"tensor{list(val.shape)}"
    text = repr(val)
    return text if len(text) <= 40 else text[:37] + "..."


def run_inputs(kwargs: dict) -> dict:
    """Run-time feature inputs of the backend protocol: sinks as float32 [num_q_heads]."""
    sinks = kwargs.get("s_aux")
    return {} if sinks is None else {"sinks": sinks.detach().float()}


class CallCounts:
    """Attention calls served by attnsel (by spec) and handed back to transformers (by reason); each reason is
    logged once."""

    def __init__(self) -> None:
        self.served: dict[AttentionSpec, int] = {}
        self.fallbacks: dict[str, int] = {}
        self._logged: set[str] = set()

    def clear(self) -> None:
        self.served.clear()
        self.fallbacks.clear()
        self._logged.clear()

    def serve(self, spec: AttentionSpec) -> None:
        self.served[spec] = self.served.get(spec, 0) + 1

    def fall_back(self, reason: str) -> None:
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1
        if reason not in self._logged:
            self._logged.add(reason)
            log.warning("attnsel: handing the call back to transformers: %s", reason)

    def summary(self) -> list[str]:
        """Two lines: the calls served, by spec; the calls handed back, by reason ("none" where there were none)."""
        served = "; ".join(f"{n} at {spec.describe()}" for spec, n in self.served.items()) or "none"
        back = "; ".join(f"{n} for {reason}" for reason, n in self.fallbacks.items()) or "none"
        return [f"attnsel: attention calls served: {served}",
                f"attnsel: attention calls handed back to transformers: {back}"]
