"""Model sizes: a LLaMA/GPT-style (optionally MoE) transformer described by Megatron-LM's flags,
and each GPU's parameter tensors in megatron-core's registration order.

Flags are read by their Megatron-LM names (``num-layers``, ``hidden-size``, ...), from a
``configs/*.yaml`` file or the command line, with Megatron-LM's defaults: ``ffn-hidden-size``
4h (with ``swiglu``: ``int(8h/3 / 64) * 64``), learned absolute position embeddings, LayerNorm
with biases, linear biases, tied embeddings, vocabulary padded to a multiple of
``make-vocab-size-divisible-by * TP``.

Parameter order (megatron-core's local layer spec, checked against its real ``GPTModel`` in
tests/unit/test_planner.py): word (+ position) embeddings; per layer input norm, ``linear_proj``,
``linear_qkv``, pre-MLP norm, ``linear_fc1``, ``linear_fc2`` (MoE: router, then each local
expert's fc1/fc2); final norm; output layer. The Transformer Engine spec fuses each norm into the
next linear layer: the same elements, a slightly different order (bucket cuts can move by one
norm, totals do not change).
"""

from dataclasses import dataclass
from typing import Any, Dict, List, NamedTuple, Optional

from .errors import PlannerError


class Param(NamedTuple):
    """One parameter tensor on one GPU: ``numel`` elements, in the expert buffer or the dense
    one, ``shared_embedding`` when megatron gives it a bucket of its own (tied embeddings with
    PP > 1)."""

    name: str
    numel: int
    expert: bool = False
    shared_embedding: bool = False


def _pos_int(d: Dict[str, Any], key: str, default=None) -> Optional[int]:
    value = d.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or int(value) != value or int(value) < 1:
        raise PlannerError(f"--{key} {value!r} must be a positive integer.")
    return int(value)


@dataclass
class ModelSpec:
    """A decoder-only transformer (dense or MoE) in Megatron-LM's terms. Raises
    :class:`PlannerError` naming the flag on invalid values."""

    num_layers: int
    """Transformer layers (``--num-layers``)."""
    hidden_size: int
    """Model width h (``--hidden-size``)."""
    num_attention_heads: int
    """Query heads (``--num-attention-heads``)."""
    seq_length: int
    """Tokens per sequence (``--seq-length``)."""
    ffn_hidden_size: Optional[int] = None
    """Dense MLP width (``--ffn-hidden-size``); None: Megatron-LM's default (4h, swiglu 8h/3)."""
    num_query_groups: Optional[int] = None
    """Key/value heads under GQA (``--num-query-groups``); None: as many as query heads."""
    kv_channels: Optional[int] = None
    """Width of one head (``--kv-channels``); None: h / heads."""
    vocab_size: int = 32000
    """Tokenizer vocabulary before padding (``--vocab-size``; 32000 = LLaMA-2/Mixtral)."""
    make_vocab_size_divisible_by: int = 128
    """Vocabulary padding multiple, times TP (``--make-vocab-size-divisible-by``)."""
    max_position_embeddings: Optional[int] = None
    """Learned position table length (``--max-position-embeddings``); None: seq-length."""
    position_embedding_type: str = "learned_absolute"
    """``learned_absolute`` (a parameter table), ``rope`` or ``none`` (no parameters)."""
    swiglu: bool = False
    """Gated SiLU MLP: fc1 is twice as wide (``--swiglu``)."""
    normalization: str = "LayerNorm"
    """``LayerNorm`` (weight and bias) or ``RMSNorm`` (weight) (``--normalization``)."""
    add_bias_linear: bool = True
    """Linear layers have biases (off with ``--disable-bias-linear``)."""
    untie_embeddings_and_output_weights: bool = False
    """Separate output layer (``--untie-embeddings-and-output-weights``)."""
    num_experts: Optional[int] = None
    """MoE experts per layer (``--num-experts``); None: dense."""
    moe_ffn_hidden_size: Optional[int] = None
    """Width of one expert (``--moe-ffn-hidden-size``); None: ffn-hidden-size."""
    moe_router_topk: int = 2
    """Experts per token (``--moe-router-topk``): sets the active parameters (FLOPs)."""

    def __post_init__(self):
        for key in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                    "vocab_size", "make_vocab_size_divisible_by", "moe_router_topk"):
            _pos_int({key: getattr(self, key)}, key.replace("_", "-"))
        h, heads = self.hidden_size, self.num_attention_heads
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = int(4 * h * 2 / 3 / 64) * 64 if self.swiglu else 4 * h
        if self.kv_channels is None:
            if h % heads:
                raise PlannerError(f"--num-attention-heads {heads} does not divide --hidden-size "
                                   f"{h}: give --kv-channels (the width of one head).")
            self.kv_channels = h // heads
        if self.num_query_groups is None:
            self.num_query_groups = heads
        if heads % self.num_query_groups:
            raise PlannerError(f"--num-query-groups {self.num_query_groups} must divide "
                               f"--num-attention-heads {heads}.")
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        if self.position_embedding_type not in ("learned_absolute", "rope", "none"):
            raise PlannerError(f"--position-embedding-type {self.position_embedding_type!r}: "
                               f"use learned_absolute, rope or none.")
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise PlannerError(f"--normalization {self.normalization!r}: use LayerNorm or "
                               f"RMSNorm.")
        if self.num_experts is not None:
            if self.moe_ffn_hidden_size is None:
                self.moe_ffn_hidden_size = self.ffn_hidden_size
            if self.moe_router_topk > self.num_experts:
                raise PlannerError(f"--moe-router-topk {self.moe_router_topk} exceeds "
                                   f"--num-experts {self.num_experts}.")

    @classmethod
    def from_flags(cls, d: Dict[str, Any]) -> "ModelSpec":
        """Build from a mapping of Megatron-LM flag names (``"num-layers": 32``, as in a
        ``configs/*.yaml`` file) to values; missing required sizes raise :class:`PlannerError`."""
        missing = [k for k in ("num-layers", "hidden-size", "num-attention-heads", "seq-length")
                   if d.get(k) is None]
        if missing:
            raise PlannerError("the model needs " + ", ".join(f"--{k}" for k in missing)
                               + " (or --config configs/<model>.yaml).")
        kw = dict(num_layers=_pos_int(d, "num-layers"), hidden_size=_pos_int(d, "hidden-size"),
                  num_attention_heads=_pos_int(d, "num-attention-heads"),
                  seq_length=_pos_int(d, "seq-length"),
                  ffn_hidden_size=_pos_int(d, "ffn-hidden-size"),
                  kv_channels=_pos_int(d, "kv-channels"),
                  vocab_size=_pos_int(d, "vocab-size", 32000),
                  make_vocab_size_divisible_by=_pos_int(d, "make-vocab-size-divisible-by", 128),
                  max_position_embeddings=_pos_int(d, "max-position-embeddings"),
                  position_embedding_type=d.get("position-embedding-type") or "learned_absolute",
                  swiglu=bool(d.get("swiglu")), normalization=d.get("normalization") or "LayerNorm",
                  add_bias_linear=not d.get("disable-bias-linear"),
                  untie_embeddings_and_output_weights=bool(
                      d.get("untie-embeddings-and-output-weights")),
                  num_experts=_pos_int(d, "num-experts"),
                  moe_ffn_hidden_size=_pos_int(d, "moe-ffn-hidden-size"),
                  moe_router_topk=_pos_int(d, "moe-router-topk", 2))
        if d.get("group-query-attention") or d.get("num-query-groups") is not None:
            kw["num_query_groups"] = _pos_int(d, "num-query-groups")
        return cls(**kw)

    def padded_vocab(self, tp: int) -> int:
        """Vocabulary rows after Megatron-LM's padding to ``divisible_by * tp``."""
        m = self.make_vocab_size_divisible_by * tp
        return -(-self.vocab_size // m) * m

    def _norm(self, name: str) -> List[Param]:
        h = self.hidden_size
        out = [Param(f"{name}.weight", h)]
        return out + [Param(f"{name}.bias", h)] if self.normalization == "LayerNorm" else out

    def _linear(self, name: str, rows: int, cols: int, bias_rows: int, expert=False):
        out = [Param(f"{name}.weight", rows * cols, expert)]
        return out + [Param(f"{name}.bias", bias_rows, expert)] if self.add_bias_linear else out

    def layer_params(self, tp: int, ep: int = 1, etp: Optional[int] = None) -> List[Param]:
        """One transformer layer's parameters on one GPU (TP shards of column- and row-parallel
        weights; norms and row-parallel biases replicated; ``num_experts / ep`` local experts,
        each sharded over ``etp``, default ``tp``)."""
        h, kv, etp = self.hidden_size, self.kv_channels, etp or tp
        q = self.num_attention_heads * kv
        qkv = (q + 2 * self.num_query_groups * kv) // tp
        out = self._norm("input_layernorm")
        out += self._linear("self_attention.linear_proj", h, q // tp, h)
        out += self._linear("self_attention.linear_qkv", qkv, h, qkv)
        out += self._norm("pre_mlp_layernorm")
        gate = 2 if self.swiglu else 1
        if self.num_experts is None:
            f = self.ffn_hidden_size // tp
            out += self._linear("mlp.linear_fc1", gate * f, h, gate * f)
            out += self._linear("mlp.linear_fc2", h, f, h)
            return out
        out.append(Param("mlp.router.weight", self.num_experts * h))
        f = self.moe_ffn_hidden_size // etp
        for e in range(self.num_experts // ep):
            name = f"mlp.experts.local_experts.{e}"
            out += self._linear(f"{name}.linear_fc1", gate * f, h, gate * f, expert=True)
            out += self._linear(f"{name}.linear_fc2", h, f, h, expert=True)
        return out

    def stage_params(self, tp: int, pp: int, stage: int, ep: int = 1,
                     etp: Optional[int] = None) -> List[Param]:
        """Parameters of one GPU of pipeline stage ``stage`` (0-based) in registration order
        (megatron-core's buckets take them in reverse). ``num_layers`` must divide by ``pp``."""
        h, vocab = self.hidden_size, self.padded_vocab(tp) // tp
        first, last = stage == 0, stage == pp - 1
        tied_split = pp > 1 and not self.untie_embeddings_and_output_weights
        out: List[Param] = []
        if first:
            out.append(Param("embedding.word_embeddings.weight", vocab * h,
                             shared_embedding=tied_split))
            if self.position_embedding_type == "learned_absolute":
                out.append(Param("embedding.position_embeddings.weight",
                                 self.max_position_embeddings * h))
        for i in range(self.num_layers // pp):
            out += [p._replace(name=f"decoder.layers.{i}.{p.name}")
                    for p in self.layer_params(tp, ep, etp)]
        if last:
            out += self._norm("decoder.final_layernorm")
            if self.untie_embeddings_and_output_weights:
                out.append(Param("output_layer.weight", vocab * h))
            elif tied_split:  # the last stage's copy of the tied embedding
                out.append(Param("output_layer.weight", vocab * h, shared_embedding=True))
        return out

    def total_params(self) -> int:
        """Parameters of the whole model (TP = PP = EP = 1, padded vocabulary)."""
        return sum(p.numel for p in self.stage_params(1, 1, 0))

    def active_params(self) -> int:
        """Parameters one token passes through, for FLOPs: all dense ones except the input
        embeddings (a lookup), and ``moe_router_topk`` experts per MoE layer."""
        total = 0
        for p in self.stage_params(1, 1, 0):
            if p.name.startswith("embedding."):
                continue
            if p.expert:
                total += p.numel * self.moe_router_topk // self.num_experts
            else:
                total += p.numel
        if not self.untie_embeddings_and_output_weights:  # the tied output projection
            total += self.padded_vocab(1) * self.hidden_size
        return total

    def flops_per_token(self) -> float:
        """Training FLOPs per token, forward + backward: ``6 * N_active + 12 * L * H * Q * S``
        (PaLM, Chowdhery et al. 2022, App. B: weights plus attention scores; no recomputation,
        causal masking not discounted)."""
        attention = 12 * self.num_layers * self.num_attention_heads * self.kv_channels \
            * self.seq_length
        return 6.0 * self.active_params() + attention
