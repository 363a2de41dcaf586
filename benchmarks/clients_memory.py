"""python -m benchmarks.clients_memory LIBRARY --out FILE: the ``temp_size_in_bytes`` of
``jax.value_and_grad`` of a next-token loss compiled with a client library's own norm and
under ``patch_<library>()`` for XLA:CPU, H100 and TPU v5e (deviceless, one device, abstract
parameters), at the widths of the 270M-1B models with fewer layers (keras: 4 layers, hidden
512), a 32k vocabulary and batch 4 x 512. Run it in a client environment of
``.ci/clients.sh`` with the compilers added."""

from __future__ import annotations

import argparse
import atexit
import collections
import json
import os
import platform
import re
import shutil
import signal
import sys
import tempfile
import time
import warnings

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("KERAS_BACKEND", "jax")  # read once, at keras's first import
# --live reads each step's buffer assignment and live ranges as the target's compiler dumps
# them (XLA:CPU, XLA:GPU and libtpu alike), where XLA is told before jax starts.
DUMP = tempfile.mkdtemp(prefix="clients_memory-") if "--live" in sys.argv else None
if DUMP:  # each compile dumps its passes' programs: hundreds of MB in a run, gone at its end
    atexit.register(shutil.rmtree, DUMP, ignore_errors=True)
    # timeout(1) and kill stop a run with SIGTERM, which ends Python without its atexit
    # calls unless it is turned into an exit (SIGKILL still leaves the folder).
    signal.signal(signal.SIGTERM, lambda signum, _: sys.exit(128 + signum))
DUMP_FLAGS = f" --xla_dump_to={DUMP} --xla_dump_hlo_as_text --xla_dump_hlo_module_re=jit_loss"
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + DUMP_FLAGS * bool(DUMP)
warnings.simplefilter("ignore", DeprecationWarning)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from rmsnorm_jax import aot, integrations  # noqa: E402

from .report import command, commit, dumps  # noqa: E402

BATCH, LENGTH, VOCAB = 4, 512, 32768
MLP = 2048  # keras: the MLP's width (--mlp)
LAYERS: dict[str, int] = {}  # --layers: a model's layer count, in place of its default
PRESET = False  # keras --preset: the public presets' sizes (KERAS_PRESETS), 1 x 2048 tokens
SPARE = 0.0  # --spare: GiB of an argument the step keeps but never reads
F32, BF16 = jnp.float32, jnp.bfloat16


# ---------------------------------------------------------------- the models, abstract


def _tunix(name: str, dtype, remat: str):
    """(abstract params, logits(params, tokens)) of a tunix model."""
    import importlib

    from flax import nnx

    m = importlib.import_module(f"tunix.models.{name}.model")
    kw = dict(
        num_layers=LAYERS.get(name, {"llama3": 4}.get(name, 6)),
        remat_config=getattr(m.RematConfig, remat),
    )
    if name == "gemma3":
        kw |= dict(num_embed=VOCAB, embed_dim=640, hidden_dim=2048, num_heads=4, head_dim=256,
                   num_kv_heads=1, sliding_window_size=512, param_dtype=dtype)  # fmt: skip
    elif name == "llama3":
        kw |= dict(vocab_size=VOCAB, embed_dim=2048, hidden_dim=8192, num_heads=32, head_dim=64,
                   num_kv_heads=8, rope_theta=500_000, norm_eps=1e-5)  # fmt: skip
    else:  # qwen3: bfloat16 activations, float32 parameters
        kw |= dict(vocab_size=VOCAB, embed_dim=1024, hidden_dim=3072, num_heads=16, head_dim=128,
                   num_kv_heads=8, rope_theta=1_000_000, norm_eps=1e-6, dtype=dtype,
                   param_dtype=F32)  # fmt: skip
    cls = {"gemma3": "Gemma3", "llama3": "Llama3", "qwen3": "Qwen3"}[name]
    model = nnx.eval_shape(lambda: getattr(m, cls)(m.ModelConfig(**kw), rngs=nnx.Rngs(0)))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    if name == "llama3" and dtype == BF16:  # no dtype in llama3's config: cast parameters
        params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, BF16), params)
    positions = jnp.arange(LENGTH)[None].repeat(BATCH, 0)
    mask = jnp.tril(jnp.ones((LENGTH, LENGTH), bool))[None].repeat(BATCH, 0)
    return params, lambda params, tokens: nnx.merge(graphdef, params, rest)(
        tokens, positions, None, mask
    )[0]


def _gemma(name: str, dtype, remat: str):
    from gemma import gm
    from gemma.gm.nn import _config, _modules

    local, glob = _modules.AttentionType.LOCAL_SLIDING, _modules.AttentionType.GLOBAL
    cfg = _config.TransformerConfig(
        num_embed=VOCAB, embed_dim=640, hidden_dim=2048, num_heads=4, head_dim=256,
        num_kv_heads=1, final_logit_softcap=None, use_post_attn_norm=True,
        use_post_ffw_norm=True, use_qk_norm=True, attention_types=(local,) * 5 + (glob,),
        sliding_window_size=512, transpose_gating_einsum=True,
    )  # fmt: skip
    model = gm.nn.Transformer(config=cfg, dtype=dtype)
    tokens = jax.ShapeDtypeStruct((BATCH, LENGTH), jnp.int32)
    params = jax.eval_shape(lambda t: model.init(jax.random.key(0), t), tokens)["params"]
    return params, lambda params, tokens: model.apply({"params": params}, tokens).logits


def _equinox(name: str, dtype, remat: str):
    import equinox as eqx

    dim, layers = 1024, 6

    class Block(eqx.Module):
        norm1: eqx.nn.RMSNorm
        attention: eqx.nn.MultiheadAttention
        norm2: eqx.nn.RMSNorm
        mlp: eqx.nn.MLP

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.norm1 = eqx.nn.RMSNorm(dim, dtype=dtype)
            self.attention = eqx.nn.MultiheadAttention(8, dim, key=k1, dtype=dtype)
            self.norm2 = eqx.nn.RMSNorm(dim, dtype=dtype)
            self.mlp = eqx.nn.MLP(dim, dim, 4 * dim, 1, jax.nn.gelu, key=k2, dtype=dtype)

        def __call__(self, x):
            h = jax.vmap(self.norm1)(x)
            x = x + self.attention(h, h, h, mask=jnp.tril(jnp.ones((LENGTH, LENGTH), bool)))
            return x + jax.vmap(self.mlp)(jax.vmap(self.norm2)(x))

    class LM(eqx.Module):
        embedding: eqx.nn.Embedding
        blocks: list
        norm: eqx.nn.RMSNorm
        head: eqx.nn.Linear

        def __init__(self, key):
            keys = jax.random.split(key, layers + 2)
            self.embedding = eqx.nn.Embedding(VOCAB, dim, key=keys[0], dtype=dtype)
            self.blocks = [Block(k) for k in keys[2:]]
            self.norm = eqx.nn.RMSNorm(dim, dtype=dtype)
            self.head = eqx.nn.Linear(dim, VOCAB, key=keys[1], dtype=dtype)

        def __call__(self, tokens):
            x = jax.vmap(self.embedding)(tokens)
            for block in self.blocks:
                x = block(x)
            return jax.vmap(self.head)(jax.vmap(self.norm)(x))

    model = eqx.filter_eval_shape(LM, jax.random.key(0))
    params, static = eqx.partition(model, lambda a: isinstance(a, jax.ShapeDtypeStruct))
    return params, lambda params, tokens: jax.vmap(eqx.combine(params, static))(tokens)


def _keras(name: str, policy: str, remat: str):
    """(trainable variables, logits(params, tokens)) of a KerasHub causal LM (no
    preprocessor) under a Keras dtype policy: its ``stateless_call``, as ``fit`` runs it."""
    import keras_hub

    m = keras_hub.models
    backbone, lm = {
        "gemma": (m.GemmaBackbone, m.GemmaCausalLM),
        "gemma3": (m.Gemma3Backbone, m.Gemma3CausalLM),
        "llama": (m.Llama3Backbone, m.Llama3CausalLM),
        "qwen3": (m.Qwen3Backbone, m.Qwen3CausalLM),
        "mistral": (m.MistralBackbone, m.MistralCausalLM),
    }[name]
    # hidden 512 in 4 heads of 128 (2 key-value heads; Gemma 3 one, as its 270M and 1B),
    # 4 layers; Gemma with Gemma 2's post-norms, Gemma 3 with its QK-norm too.
    kw = dict(vocabulary_size=VOCAB, num_layers=LAYERS.get(name, 4), hidden_dim=512,
              intermediate_dim=MLP, num_query_heads=4, num_key_value_heads=2,
              dtype=policy)  # fmt: skip
    post = dict(use_post_ffw_norm=True, use_post_attention_norm=True)
    kw |= {
        "gemma": dict(head_dim=128, **post),
        "gemma3": dict(head_dim=128, num_key_value_heads=1, image_size=16,
                       use_sliding_window_attention=True, sliding_window_size=512, **post),
        "qwen3": dict(head_dim=128),
        "mistral": dict(head_dim=128, sliding_window=512),
    }.get(name, {})  # fmt: skip
    if PRESET:
        kw = KERAS_PRESETS[name][1] | dict(dtype=policy)
    model = lm(backbone=backbone(**kw), preprocessor=None)
    trainable = [v.value for v in model.trainable_variables]
    frozen = [v.value for v in model.non_trainable_variables]

    def logits(params, tokens):
        x = {"token_ids": tokens, "padding_mask": jnp.ones_like(tokens, bool)}
        return model.stateless_call(params, frozen, x)[0]

    return trainable, logits


# --preset: the sizes of KerasHub's smallest public preset of three families (each preset's
# config.json), built from arguments with fresh weights (nothing is downloaded).
KERAS_PRESETS = {
    "gemma3": ("gemma3_1b", dict(vocabulary_size=262144, image_size=896, num_layers=26,
               num_query_heads=4, num_key_value_heads=1, hidden_dim=1152, intermediate_dim=6912,
               head_dim=256, use_post_ffw_norm=True, use_post_attention_norm=True,
               use_sliding_window_attention=True, sliding_window_size=512,
               local_rope_scaling_factor=1.0, global_rope_scaling_factor=1.0)),
    "llama": ("llama3.2_1b", dict(vocabulary_size=128256, num_layers=16, num_query_heads=32,
              num_key_value_heads=8, hidden_dim=2048, intermediate_dim=8192,
              rope_max_wavelength=500000, rope_frequency_adjustment_factor=32.0,
              rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
              rope_pretraining_sequence_length=8192, layer_norm_epsilon=1e-5,
              tie_word_embeddings=True)),
    "qwen3": ("qwen3_0.6b_en", dict(vocabulary_size=151936, num_layers=28, num_query_heads=16,
              num_key_value_heads=8, hidden_dim=1024, intermediate_dim=3072, head_dim=128,
              rope_max_wavelength=1000000, layer_norm_epsilon=1e-6)),
}  # fmt: skip


class KerasDirect:
    """Issue 45's measurement: each norm class of the five KerasHub models above with its
    ``call`` replaced by a plain ``rms_norm`` call in ``rms_norm``'s own semantics (its
    output dtype rules, the layer's ``scale`` and ``epsilon``), written without
    ``patch_keras``'s machinery; a context like a ``Patch`` (``calls``, ``undo()``)."""

    CLASSES = (  # (module under keras_hub.src.models, class, scale offset)
        ("gemma.rms_normalization", "RMSNormalization", 1.0),
        ("gemma3.gemma3_layers", "RMSNormalization", 1.0),
        ("llama.llama_layernorm", "LlamaLayerNorm", 0.0),
        ("qwen3.qwen3_layernorm", "Qwen3LayerNorm", 0.0),
        ("mistral.mistral_layer_norm", "MistralLayerNormalization", 0.0),
    )

    def __init__(self):
        import importlib

        from rmsnorm_jax import rms_norm

        self.calls, self._saved = 0, []

        def direct(offset):
            def call(layer, x):
                self.calls += 1
                return rms_norm(x, layer.scale, layer.epsilon, scale_offset=offset)

            return call

        for module, name, offset in self.CLASSES:
            cls = getattr(importlib.import_module(f"keras_hub.src.models.{module}"), name)
            self._saved.append((cls, cls.__dict__["call"]))
            cls.call = direct(offset)
        jax.clear_caches()

    def undo(self):
        for cls, call in self._saved:
            cls.call = call
        jax.clear_caches()


KERAS = [(name, policy, "NONE") for name in ("gemma", "gemma3", "llama", "qwen3", "mistral")
         for policy in ("bfloat16", "mixed_bfloat16")]  # fmt: skip
LIBRARIES = {  # (build, patch, [(model, dtype, remat)]); qwen3 bfloat16: float32 parameters
    "tunix": (_tunix, integrations.patch_tunix, [("gemma3", F32, "NONE"), ("gemma3", BF16, "NONE"),
              ("llama3", BF16, "BLOCK"), ("qwen3", BF16, "NONE"), ("qwen3", BF16, "DECODER")]),
    "gemma": (_gemma, integrations.patch_gemma, [("gemma3", F32, "NONE"),
              ("gemma3", BF16, "NONE")]),
    "equinox": (_equinox, integrations.patch_equinox, [("lm", F32, "NONE"), ("lm", BF16, "NONE")]),
    "keras": (_keras, integrations.patch_keras, KERAS),  # dtype: a Keras dtype policy
}  # fmt: skip


# ---------------------------------------------------------------- compiling


def _entry(hlo: str) -> str:
    """The entry computation of an HLO module's text, its header line first."""
    entry = hlo[hlo.index("\nENTRY") :]
    return entry[: entry.index("\n}\n")]


def activation_buffers(hlo: str) -> collections.Counter:
    """Per shape ``[BATCH, LENGTH, d]`` (any dtype), how many instructions of the compiled
    program's entry computation write a new buffer of it (aliases, parameters and
    constants aside; a tuple-valued instruction counts once per such element)."""
    found = collections.Counter()
    for line in _entry(hlo).splitlines()[1:]:
        match = re.match(r"\s*(?:ROOT )?%\S+ = (.*?) ([a-z][\w\-]*)\(", line)
        if not match or match.group(2) in ALIASES:
            continue
        for dtype, dims in re.findall(r"\b([a-z]+\d+)\[([\d,]+)\]", match.group(1)):
            if dims.startswith(f"{BATCH},{LENGTH},") and dims.count(",") == 2:
                found[f"{dtype}[{dims}]"] += 1
    return found


def live_peak() -> int:
    """The most bytes live at once in the newest dumped step's own buffers (any target):
    at each point of the schedule, the bytes that the values XLA holds live there cover in
    the temp allocation and in the outputs' (each value's allocation, offset and size from
    the buffer assignment, its live range from the compiler's own ``HloLiveRange``). The
    outputs' allocations count because the buffer assigner lends an output's space to
    temporaries until the output is written; the arguments', the same in both steps and
    held by the caller throughout, do not. The temp and output sizes less this are what
    the placement leaves unused."""
    dumps = [
        os.path.join(DUMP, f) for f in os.listdir(DUMP) if f.endswith("-buffer-assignment.txt")
    ]
    stem = max(dumps, key=os.path.getmtime).removesuffix("-buffer-assignment.txt")
    placed, counted = {}, None  # a value ("name{index}") -> (allocation, offset, size)
    value = re.compile(r"\s*value: <\d+ (\S+) @\d+> \(size=(\d+),offset=(\d+)")
    for line in open(f"{stem}-buffer-assignment.txt"):
        if line.startswith("allocation "):  # the default memory's (a TPU's others: color N)
            own = "preallocated-temp" in line or "maybe-live-out" in line
            counted = line.split(":")[0] if own and "color" not in line else None
        elif counted and (found := value.match(line)):
            name = found.group(1)  # as the live ranges name it: a whole value's index {}
            name = name if name.endswith("}") else f"{name}{{}}"
            placed[name] = (counted, int(found.group(3)), int(found.group(2)))
    spans = []  # (first, last, allocation, offset, size): where each value is live
    for line in open(f"{stem}-live-range.txt"):
        found = re.match(r"\s+(\S+):(\d+)-(\d+)$", line)
        if found and found.group(1) in placed:
            spans.append((int(found.group(2)), int(found.group(3)), *placed[found.group(1)]))

    def live_at(at: int) -> int:  # per allocation, the union of the live values' bytes
        ranges = collections.defaultdict(list)
        for first, last, allocation, offset, size in spans:
            if first <= at <= last:
                ranges[allocation].append((offset, offset + size))
        return sum(map(_covered, ranges.values()))

    return max(map(live_at, {first for first, *_ in spans}))  # it rises only where one starts


def _covered(intervals: list[tuple[int, int]]) -> int:
    """How many bytes the union of the byte ranges [start, end) covers."""
    total, reached = 0, 0
    for start, end in sorted(intervals):
        total += max(0, end - max(start, reached))
        reached = max(reached, end)
    return total


ALIASES = {"get-tuple-element", "bitcast", "tuple", "parameter", "constant"}


def temp_bytes(
    build, patch, config, target, *, more=(), buffers=None, live=None, estimates=None, peaks=None
) -> tuple[int | str, ...]:
    """(the library's norm, ours, then one per context maker of ``more``): temp bytes of
    the compiled value_and_grad step (the compiler's words where it does not fit); each
    program's ``activation_buffers`` appended to a list ``buffers``, its ``live_peak()``
    to a list ``live`` (``--live``), the
    compiler's cost-model estimate of the whole step to a list ``estimates`` (a GPU's
    microseconds, a TPU's cycles; None on XLA:CPU), its ``peak_memory_in_bytes`` to a list
    ``peaks`` (``--peak``). With ``SPARE`` the step also takes an argument of that many GiB
    that it never reads (``--spare``): the room each program leaves on the chip."""
    mesh = jax.sharding.Mesh(np.array(target.devices[:1], dtype=object), ("devices",))
    result = []
    for maker in (None, patch, *more):
        patched = maker() if maker else None
        try:
            params, logits = build(*config)

            def loss(params, tokens, logits=logits):
                out = logits(params, tokens)[:, :-1].astype(F32)
                nll = -jnp.take_along_axis(jax.nn.log_softmax(out), tokens[:, 1:, None], -1)
                return nll.mean()

            params = jax.tree.map(lambda a: aot.struct(a.shape, a.dtype, mesh, P()), params)
            tokens = aot.struct((BATCH, LENGTH), jnp.int32, mesh, P())
            step, args = jax.jit(jax.value_and_grad(loss)), (params, tokens)
            if SPARE:  # the same step, holding an argument it never reads
                step = jax.jit(lambda *a: jax.value_and_grad(loss)(*a[:2]), keep_unused=True)
                args += (aot.struct((round(SPARE * 2**18), 2**10), F32, mesh, P()),)
            try:
                compiled = target.compile(step, *args)
            except jax.errors.JaxRuntimeError as e:  # more than the target's memory
                if "RESOURCE_EXHAUSTED" not in str(e):
                    raise
                result.append(str(e).split("RESOURCE_EXHAUSTED: ")[-1].splitlines()[0])
                for found in (estimates, peaks):
                    if found is not None:
                        found.append(None)
                continue
            analysis = compiled.memory_analysis()
            result.append(int(analysis.temp_size_in_bytes))
            if peaks is not None:
                peaks.append(int(analysis.peak_memory_in_bytes))
            if buffers is not None:
                buffers.append(activation_buffers(compiled.as_text()))
            if live is not None:
                live.append(live_peak())
            if estimates is not None:
                estimates.append(aot.estimate(compiled, target))
            assert patched is None or patched.calls > 0, repr(patched)  # the model was reached
        finally:
            if patched is not None:
                patched.undo()
    return tuple(result)


OPTIONS = [
    ("--targets", dict(default="cpu,h100,tpu-v5e")),
    ("--only", dict(default="", help="comma-separated models, or model:REMAT (qwen3:DECODER)")),
    ("--out", dict(required=True)),
    ("--layers", dict(type=int, default=0, help="the tunix models' layer count (default: theirs)")),
    ("--vocab", dict(type=int, default=VOCAB, help="the vocabulary (default: 32768)")),
    ("--mlp", dict(type=int, default=MLP, help="keras: the MLP's width (default: 2048)")),
    ("--direct", dict(action="store_true", help="keras: issue 45's direct swap beside ours")),
    ("--preset", dict(action="store_true", help="keras: public presets' sizes, 1 x 2048 tokens")),
    ("--merge", dict(help="a results file whose other rows --out keeps")),
    ("--peak", dict(action="store_true", help="each step's peak_memory_in_bytes beside")),
    ("--spare", dict(type=float, default=0.0, help="GiB of an argument kept, never read")),
    ("--live", dict(action="store_true", help="the most bytes live at once, arguments aside")),
    ("--buffers", dict(action="store_true", help="activation-shaped buffers each program writes")),
]


def main() -> None:
    parser = argparse.ArgumentParser("python -m benchmarks.clients_memory", description=__doc__)
    parser.add_argument("library", choices=sorted(LIBRARIES))
    for flag, kw in OPTIONS:
        parser.add_argument(flag, **kw)
    args = parser.parse_args()
    if args.direct and args.library != "keras":
        parser.error(
            f"--direct is issue 45's swap of KerasHub's norms: keras only, not {args.library}"
        )
    if args.preset and args.library != "keras":
        parser.error(f"--preset is KerasHub's presets' sizes: keras only, not {args.library}")
    global VOCAB, MLP, PRESET, BATCH, LENGTH, SPARE
    VOCAB, MLP, SPARE = args.vocab, args.mlp, args.spare
    build, patch, configs = LIBRARIES[args.library]
    only = args.only.split(",")
    configs = [c for c in configs if not args.only or c[0] in only or f"{c[0]}:{c[2]}" in only]
    if args.preset:
        PRESET, (BATCH, LENGTH) = True, (1, 2048)
        configs = [c for c in configs if c[0] in KERAS_PRESETS]
    provenance = dict(command=command(sys.argv[1:], "python -m benchmarks.clients_memory"))
    provenance |= dict(commit=commit(), python=platform.python_version(), jax=jax.__version__)
    rows = []
    for target in map(aot.get_target, args.targets.split(",")):
        for model, dtype, remat in configs:
            start = time.time()
            LAYERS.update({model: args.layers} if args.layers else {})
            buffers = [] if args.buffers else None
            live = [] if args.live else None
            more, estimates, peaks = (KerasDirect,) if args.direct else (), [], []
            found = temp_bytes(build, patch, (model, dtype, remat), target, more=more,
                               buffers=buffers, live=live, estimates=estimates,
                               peaks=peaks if args.peak else None)  # fmt: skip
            theirs, ours = found[:2]
            name = dtype if isinstance(dtype, str) else jnp.dtype(dtype).name
            row = dict(library=args.library, model=model, dtype=name, remat=remat)
            row |= dict(target=target.name, theirs_MiB=_mib(theirs), ours_MiB=_mib(ours))
            fits = isinstance(theirs, int) and isinstance(ours, int)
            row |= dict(ratio=round(ours / theirs, 3) if fits else None)
            refused = [f for f in (theirs, ours) if isinstance(f, str)]
            row |= {"does_not_fit": refused[0]} if refused else {}
            row |= {"layers": args.layers} if args.layers else {}
            row |= {"vocab": VOCAB} if VOCAB != 32768 and not PRESET else {}
            row |= {"mlp": MLP} if MLP != 2048 and not PRESET else {}
            row |= {"preset": KERAS_PRESETS[model][0], "batch": [BATCH, LENGTH]} if PRESET else {}
            row |= {"direct_MiB": round(found[2] / 2**20, 1)} if args.direct else {}
            row |= {"spare_GiB": SPARE} if SPARE else {}
            if args.peak:  # arguments, outputs and temporaries: what the chip must hold
                row |= dict(theirs_peak_MiB=_mib(peaks[0]), ours_peak_MiB=_mib(peaks[1]))
            if target.estimate_unit is not None and fits:  # the step's cost model: us or cycles
                theirs_e, ours_e = (round(e, 1) for e in estimates[:2])
                row |= dict(estimate_unit=target.estimate_unit, theirs_estimate=theirs_e)
                row |= dict(ours_estimate=ours_e)
            row |= {"buffers_theirs": buffers[0], "buffers_ours": buffers[1]} if buffers else {}
            mib = [round(b / 2**20, 1) for b in live or []]
            row |= {"theirs_live_MiB": mib[0], "ours_live_MiB": mib[1]} if mib else {}
            rows.append(row | provenance)
            print(json.dumps(rows[-1]), f"({time.time() - start:.0f} s)", flush=True)
    meta = {"batch": [BATCH, LENGTH], "vocab": VOCAB}  # a --preset row has its own batch
    if args.merge:  # the rows of another run, less those this run measured again
        measured = {_key(r) for r in rows}
        with open(args.merge) as f:
            merged = json.load(f)
        rows = [r for r in merged["rows"] if _key(r) not in measured] + rows
        meta = merged.get("meta", meta)  # the file's own, its note kept
    with open(args.out, "w") as f:
        f.write(dumps({"meta": meta, "rows": rows}) + "\n")


def _mib(found: int | str) -> float | None:
    """Bytes in MiB (one decimal); None where the step did not fit."""
    return round(found / 2**20, 1) if isinstance(found, int) else None


def _key(row: dict) -> tuple:
    """What a row measures: the same key in two runs is the same measurement."""
    keys = ("library", "model", "dtype", "remat", "target", "layers", "vocab", "mlp", "preset")
    keys += ("spare_GiB",)
    return tuple(row.get(k) for k in keys)


if __name__ == "__main__":
    main()
