"""The code of README.md and docs/*.md, checked against the package.

Every fenced block is one test case, named by file and line:

- ```` ```python ````: an example. It runs as written, in a fresh namespace, after ``torch.manual_seed(0)``,
  on one CPU thread, with FutureWarnings as errors; an exception fails the case with the block's
  location. Names a block uses without defining them must be placeholders of ``PLACEHOLDERS`` (what a
  reader brings: ``name`` of a checkpoint; or what an earlier block of the same page built: ``model``,
  ``tokenizer``, ``inputs``, ``PagedCache``), any other undefined name fails the case. The
  placeholders are tiny local objects: ``name`` is a temporary directory holding a random-weight Llama
  (tests/hf_models.py's size) and a character-level tokenizer; nothing is downloaded.
  The examples pass the cache to ``generate()`` as ``cache=`` (transformers >= 5.24; the pages say
  that older releases call it ``past_key_values=``). With an older transformers installed, the case
  renames that keyword in calls of ``model.generate(...)`` and ``model(...)`` before running the block
  (an AST rewrite, nothing else changes), so ``make test-compat`` runs the same examples on both ends of
  the supported range.
- ```` ```python synopsis ````: an API listing (signatures, ``...``, ``->``), not runnable and not run;
  GitHub still highlights it as Python. The op signatures of docs/api.md are compared with
  ``kvkernels.ops`` and ``kvkernels.reference``, and the attributes a listing names on the objects it
  constructs or gets back (``cache.x``, ``pool.x``, ``result.x``, ...) must exist.
- ```` ```text ```` holding ``kvkernels::`` schemas (docs/design.md): equal to the registered schemas of
  ``torch.ops.kvkernels``, every op listed.
- Anything else (bash, plain listings): not checked.
"""

from __future__ import annotations

import ast
import builtins
import functools
import inspect
import re
import warnings
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

import kvkernels

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


class Block(NamedTuple):
    path: Path
    line: int  # 1-based line of the opening fence
    info: str  # the fence's info string
    code: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def _blocks(path: Path) -> list[Block]:
    out, lines, i = [], path.read_text().splitlines(), 0
    while i < len(lines):
        m = re.match(r"^(`{3,})(.*)$", lines[i])
        if not m:
            i += 1
            continue
        fence, info, start = m.group(1), m.group(2).strip(), i
        i += 1
        body = []
        while i < len(lines) and not lines[i].startswith(fence):
            body.append(lines[i])
            i += 1
        assert i < len(lines), f"{path.relative_to(ROOT)}:{start + 1}: unclosed code block"
        out.append(Block(path, start + 1, info, "\n".join(body) + "\n"))
        i += 1
    return out


BLOCKS = [b for p in PAGES for b in _blocks(p)]
EXAMPLES = [b for b in BLOCKS if b.info == "python"]
SYNOPSES = [b for b in BLOCKS if b.info == "python synopsis"]
SCHEMA_BLOCKS = [b for b in BLOCKS if b.info == "text" and "kvkernels::" in b.code]


def test_every_python_block_is_classified():
    """A block marked python is either an example (run) or a synopsis (checked): no third kind."""
    odd = [f"{b.where}: ```{b.info}" for b in BLOCKS if b.info.split()[:1] == ["python"]
           and b.info not in ("python", "python synopsis")]
    assert not odd, odd
    assert len(EXAMPLES) >= 5 and SCHEMA_BLOCKS, "the pages lost their examples?"


# ---- placeholders ------------------------------------------------------------------------------

_CHARS = [chr(c) for c in range(32, 127)]  # printable ASCII: one token per character
_SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]  # ids 0..3: pad, bos, eos as in tests/hf_models.py


@functools.lru_cache(maxsize=None)
def _checkpoint() -> str:
    """A directory holding a tiny random-weight Llama and a character-level tokenizer (the ``name``
    an example loads with ``from_pretrained``)."""
    import atexit
    import shutil
    import tempfile

    import transformers as tf
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    from hf_models import COMMON, VOCAB

    words = _SPECIALS + _CHARS
    words += [f"<extra_{i}>" for i in range(VOCAB - len(words))]  # every id the model can emit decodes
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tokenizer = tf.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                           eos_token="</s>", unk_token="<unk>",
                                           model_input_names=["input_ids", "attention_mask"])
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**COMMON))
    path = tempfile.mkdtemp(prefix="kvkernels-docs-model-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _model():
    from transformers import AutoModelForCausalLM

    from kvkernels.integrations.transformers import register
    register()
    return AutoModelForCausalLM.from_pretrained(_checkpoint(), attn_implementation="kvkernels")


def _tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(_checkpoint())


def _paged_cache_class():
    from kvkernels.integrations.transformers import PagedCache
    return PagedCache


# name -> a factory, called only for the blocks that use the name.
PLACEHOLDERS = {
    "name": _checkpoint,
    "model": _model,
    "tokenizer": _tokenizer,
    "inputs": lambda: _tokenizer()("The capital of France is", return_tensors="pt"),
    "PagedCache": _paged_cache_class,
}


def _free_names(tree: ast.Module) -> set[str]:
    """Names the block reads but never binds (assignments, imports, defs, loop and comprehension
    targets, arguments), builtins excluded. Flow-insensitive: enough for examples."""
    bound, read = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
    return read - bound - set(dir(builtins))


class _OldCacheName(ast.NodeTransformer):
    """``cache=`` -> ``past_key_values=`` in ``model.generate(...)`` and ``model(...)`` calls, for a
    transformers from before the 5.24 rename."""

    def visit_Call(self, node: ast.Call) -> ast.Call:
        self.generic_visit(node)
        f = node.func
        if (isinstance(f, ast.Name) and f.id == "model") or (
                isinstance(f, ast.Attribute) and f.attr == "generate" and isinstance(f.value, ast.Name)
                and f.value.id == "model"):
            for kw in node.keywords:
                if kw.arg == "cache":
                    kw.arg = "past_key_values"
        return node


def _uses_transformers(tree: ast.Module, free: set[str]) -> bool:
    mods = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    mods |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    return bool(free & set(PLACEHOLDERS)) or any(m.split(".")[0] == "transformers" or "integrations" in m
                                                  or m == "kvkernels.generation" for m in mods)


def _uses_jax(tree: ast.Module) -> bool:
    mods = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    mods |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    return any(m.split(".")[0] == "jax" or m.startswith("kvkernels.jax") for m in mods)


@pytest.mark.parametrize("block", EXAMPLES, ids=[b.where for b in EXAMPLES])
def test_example_runs(block: Block, request):
    tree = ast.parse(block.code, filename=block.where)
    free = _free_names(tree)
    unknown = free - set(PLACEHOLDERS)
    assert not unknown, f"{block.where}: the example uses undefined names {sorted(unknown)}"
    if _uses_jax(tree):  # docs/jax.md: skips (saying so) without jax; builds the library otherwise
        pytest.importorskip("jax", reason="jax is not installed (the JAX tests need jax and jaxlib from "
                                          "requirements/lock.txt: pip install -c requirements/lock.txt jax jaxlib)")
        request.getfixturevalue("jax_library_path")
    if _uses_transformers(tree, free):
        pytest.importorskip("transformers")
        from kvkernels.integrations.transformers_compat import generate_cache_name
        if generate_cache_name() != "cache":
            tree = ast.fix_missing_locations(_OldCacheName().visit(tree))
    namespace = {"__name__": "__docs_example__"}
    namespace.update({n: PLACEHOLDERS[n]() for n in sorted(free)})
    torch.manual_seed(0)
    code = compile(tree, block.where, "exec")
    threads = torch.get_num_threads()
    # One thread: the examples' tiny matrices gain nothing from more, and on a loaded machine torch's
    # waiting worker threads made the transformers examples ~50x slower.
    torch.set_num_threads(1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)  # e.g. a deprecated argument name
            exec(code, namespace)
    except Exception as e:
        raise AssertionError(f"{block.where}: the example raised {type(e).__name__}: {e}") from e
    finally:
        torch.set_num_threads(threads)


# ---- the README's stacked copy_blocks, beyond the example's own assert ---------------------------


def test_stacked_copy_blocks_needs_block_dim():
    """On the stacked [L, 2, N, B, H, D] allocation of the README, block_dim=2 copies blocks in every
    layer and touches nothing else; the default block_dim=0 would index layers (here: copy layer 0
    over layer 1), which is why the pages say to pass block_dim."""
    L, N, B, H, D = 2, 64, 16, 2, 64
    kv = torch.randn(L, 2, N, B, H, D).to(torch.bfloat16)
    before = kv.clone()
    kvkernels.ops.copy_blocks(kv, torch.tensor([[12, 50], [40, 51]]), block_dim=2)
    expect = before.clone()
    expect[:, :, 50], expect[:, :, 51] = before[:, :, 12], before[:, :, 40]
    assert torch.equal(kv, expect)

    wrong = before.clone()
    kvkernels.ops.copy_blocks(wrong, torch.tensor([[0, 1]]))  # block_dim=0: "blocks" 0 and 1 are layers
    assert torch.equal(wrong[1], before[0]) and not torch.equal(wrong, before)
    with pytest.raises(RuntimeError, match="kvkernels.copy_blocks: block_mapping"):
        kvkernels.ops.copy_blocks(before.clone(), torch.tensor([[12, 50]]))  # past the 2 "blocks" of dim 0


# ---- schemas (docs/design.md) ------------------------------------------------------------------

OPS = ("reshape_and_cache", "paged_attention", "merge_attention_states", "copy_blocks", "swap_blocks",
       "gather_kv", "concat_and_cache_mla", "mla_decompress", "mla_paged_attention")
# Ops with a schema but no wrapper of their own (the wrappers' out= calls them).
OUT_OPS = ("paged_attention_out", "merge_attention_states_out", "mla_paged_attention_out")


def _statements(code: str) -> list[str]:
    """Lines joined with their indented continuation lines."""
    out = []
    for line in code.splitlines():
        if line[:1].isspace() and out:
            out[-1] += " " + line.strip()
        elif line.strip():
            out.append(line.strip())
    return out


@pytest.mark.parametrize("block", SCHEMA_BLOCKS, ids=[b.where for b in SCHEMA_BLOCKS])
def test_schemas_match_the_registered_ops(block: Block):
    documented = {}
    for stmt in _statements(block.code):
        schema = torch._C.parse_schema(stmt)  # normalizes spelling (1e-6, 0.0)
        documented[schema.name] = str(schema)
    ops_ = OPS + OUT_OPS
    registered = {f"kvkernels::{op}": str(getattr(torch.ops.kvkernels, op).default._schema) for op in ops_}
    assert set(documented) == set(registered), f"{block.where}: ops listed differ from {ops_}"
    for op, schema in registered.items():
        assert documented[op] == schema, f"{block.where}: {op}: documented\n  {documented[op]}\nregistered\n  {schema}"


# ---- synopses ----------------------------------------------------------------------------------


def _signature(stmt: str) -> inspect.Signature | None:
    """``name(params) -> ret  # comment`` as an inspect.Signature, or None if it is not that shape."""
    m = re.match(r"^(\w+)\((.*)\)\s*(->.*)?$", stmt.split("  #")[0].strip())
    if not m:
        return None
    fn = ast.parse(f"def {m.group(1)}({m.group(2)}): pass").body[0]
    a, params = fn.args, []
    defaults = [None] * (len(a.args) - len(a.defaults)) + list(a.defaults)
    for arg, d in zip(a.args, defaults):
        params.append(inspect.Parameter(arg.arg, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                        default=inspect.Parameter.empty if d is None else ast.literal_eval(d)))
    for arg, d in zip(a.kwonlyargs, a.kw_defaults):
        params.append(inspect.Parameter(arg.arg, inspect.Parameter.KEYWORD_ONLY,
                                        default=inspect.Parameter.empty if d is None else ast.literal_eval(d)))
    return inspect.Signature(params)


def _bare(sig: inspect.Signature) -> inspect.Signature:
    return sig.replace(parameters=[p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()],
                       return_annotation=inspect.Signature.empty)


def test_api_op_signatures():
    """docs/api.md's first synopsis lists every op with the signature of kvkernels.ops and
    kvkernels.reference."""
    block = next(b for b in SYNOPSES if b.path.name == "api.md")
    listed = {}
    for stmt in _statements(block.code):
        sig = _signature(stmt)
        if sig is not None:
            listed[stmt.split("(")[0]] = sig
    assert set(listed) == set(OPS), f"{block.where}: ops listed: {sorted(listed)}"
    for op, sig in listed.items():
        for module in (kvkernels.ops, kvkernels.reference):
            actual = _bare(inspect.signature(getattr(module, op)))
            assert sig == actual, f"{block.where}: {op}: documented {sig}, {module.__name__} has {actual}"


def _instances() -> dict[str, object]:
    """Class name -> a tiny real instance, for the attribute check of the synopses."""
    kv = kvkernels.PagedKVCache(2, 2, 8, 16, block_size=4)
    mla = kvkernels.MLAPagedCache(2, 16, 8, 16, block_size=4)
    return {"PagedKVCache": kv, "MLAPagedCache": mla, "BlockPool": kvkernels.BlockPool(16, 4)}


def _transformers_instances() -> dict[str, object]:
    from hf_models import config_for

    from kvkernels.integrations.transformers import PagedCache
    config, _, _ = config_for("llama")
    return {"PagedCache": PagedCache(config)}


def _namespaces() -> list:
    import kvkernels.cache
    mods = [kvkernels, kvkernels.cache]
    try:
        import kvkernels.generation
        import kvkernels.integrations.transformers
        mods += [kvkernels.generation, kvkernels.integrations.transformers]
    except ImportError:  # no transformers
        pass
    return mods


def _attributes(kind: tuple) -> set[str] | None:
    """What an object of ``kind`` has: ("instance", obj) or ("class", cls) (dataclass fields included)."""
    import dataclasses
    what, obj = kind
    names = set(dir(obj))
    if what == "class" and dataclasses.is_dataclass(obj):
        names |= {f.name for f in dataclasses.fields(obj)}
    return names


def _returns(fn) -> tuple | None:
    import typing
    try:
        ret = typing.get_type_hints(fn).get("return")
    except Exception:
        return None
    return ("class", ret) if isinstance(ret, type) else None


@pytest.mark.parametrize("block", SYNOPSES, ids=[b.where for b in SYNOPSES])
def test_synopsis_names_exist(block: Block):
    """Every ``from kvkernels... import`` name of a synopsis imports; for ``var = Class(...)`` or
    ``var = function(...)`` (annotated return type) in it, every ``var.attr`` it names after that,
    ``, .attr`` continuations of a ``var.attr, ...`` line included, exists: on a real instance of the
    cache classes, on the class otherwise."""
    for m in re.finditer(r"^from (kvkernels[\w.]*) import (?:\(([^)]*)\)|([\w ,]+)$)", block.code, re.M):
        if "integrations" in m.group(1) or m.group(1) == "kvkernels.generation":
            pytest.importorskip("transformers")
        module = __import__(m.group(1), fromlist=["_"])
        for name in filter(None, (n.strip() for n in (m.group(2) or m.group(3)).split(","))):
            assert hasattr(module, name), f"{block.where}: {m.group(1)} has no {name}"
    instances = _instances()
    if re.search(r"\bPagedCache\(", block.code):
        pytest.importorskip("transformers")
        instances.update(_transformers_instances())
    mods = _namespaces()
    kinds: dict[str, tuple] = {}  # variable -> what it holds now
    checked = 0
    code = "\n".join(line.split("#")[0] for line in block.code.splitlines())  # not the comments
    for stmt in _statements(code):
        for var, kind in kinds.items():
            attrs = re.findall(rf"(?<![\w.]){var}\.(\w+)", stmt)
            if stmt.startswith(f"{var}.") and "[" not in stmt:
                attrs += re.findall(r",\s*\.(\w+)", stmt)
            for attr in attrs:
                assert attr in _attributes(kind), f"{block.where}: {kind[1]!r} has no attribute {attr!r}"
                checked += 1
        m = re.match(r"^(\w+) = (\w+)(?:\.(\w+))?\(", stmt)
        if not m:
            continue
        var, callee, method = m.groups()
        kind = None
        if method is not None and callee in kinds and kinds[callee][0] == "class":
            kind = _returns(getattr(kinds[callee][1], method, None))
        elif method is None and callee in instances:
            kind = ("instance", instances[callee])
        elif method is None:
            found = next((getattr(mod, callee) for mod in mods if hasattr(mod, callee)), None)
            if isinstance(found, type):
                kind = ("class", found)
            elif callable(found):
                kind = _returns(found)
        if kind is None:
            kinds.pop(var, None)
        else:
            kinds[var] = kind
    if re.search(r"^(cache|pool) = ", block.code, re.M):
        assert checked, f"{block.where}: nothing checked"
