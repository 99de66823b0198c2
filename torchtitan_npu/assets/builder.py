"""Build and cache the default corpus and tokenizer (see package docstring)."""

import hashlib
import importlib
import inspect
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

# Bump when the corpus or tokenizer recipe changes: it keys the cache.
RECIPE_VERSION = 1

VOCAB_SIZE = 2048  # the vocab of upstream's llama3 "debugmodel" flavor
BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"

# Standard-library modules whose docstrings make up the corpus, in this order.
CORPUS_MODULES = (
    "abc argparse ast asyncio.base_events asyncio.events asyncio.futures "
    "asyncio.locks asyncio.queues asyncio.streams asyncio.tasks base64 bisect "
    "calendar cmd codecs collections concurrent.futures configparser contextlib "
    "copy csv dataclasses datetime decimal difflib dis email.message "
    "email.utils enum filecmp fnmatch fractions ftplib functools getopt gettext "
    "glob gzip hashlib heapq hmac html.parser http.client http.cookiejar "
    "http.server imaplib inspect io ipaddress json json.decoder json.encoder "
    "locale logging logging.handlers mailbox mimetypes multiprocessing.pool "
    "netrc numbers operator optparse os pathlib pickle pkgutil platform plistlib "
    "poplib pprint profile pstats queue quopri random re shlex shutil "
    "smtplib socket socketserver sqlite3 statistics string struct subprocess "
    "tarfile tempfile textwrap threading timeit tokenize traceback turtle types "
    "typing unittest.case unittest.mock urllib.parse urllib.request uuid "
    "warnings wave weakref xml.dom.minidom xml.etree.ElementTree zipfile zipimport"
).split()

# Held-out modules: the embedded validation set (the same prose, none of the
# corpus's docstrings). Built beside the corpus, so the corpus is unchanged.
VALIDATION_MODULES = (
    "code codeop colorsys compileall doctest email.headerregistry email.parser "
    "graphlib http.cookies importlib.abc linecache logging.config "
    "multiprocessing.managers pdb pydoc reprlib runpy sched secrets selectors "
    "stat symtable sysconfig tabnanny trace tracemalloc unittest.loader "
    "urllib.robotparser wsgiref.handlers xml.sax.handler xmlrpc.client zoneinfo"
).split()

MIN_DOC_CHARS = 200  # shorter docstrings are mostly signatures, not prose


@dataclass(frozen=True)
class DefaultAssets:
    """Paths of the built assets."""

    root: Path
    dataset_path: Path  # a folder `datasets.load_dataset` reads (data.jsonl)
    validation_path: Path  # the same, held out from the corpus
    tokenizer_path: Path  # a folder with tokenizer.json + tokenizer_config.json
    corpus_sha256: str


def cache_base() -> Path:
    """titan-npu's cache folder: $TITAN_NPU_CACHE, else ~/.cache/titan-npu."""
    return Path(
        os.environ.get("TITAN_NPU_CACHE")
        or os.path.join(
            os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
            "titan-npu",
        )
    )


def cache_root() -> Path:
    version = f"py{sys.version_info.major}{sys.version_info.minor}"
    return cache_base() / f"default-assets-v{RECIPE_VERSION}-{version}"


def _public_docs(module) -> list[str]:
    """Docstrings of a module, its classes and functions, in source order."""
    docs = [inspect.getdoc(module) or ""]
    members = []
    for name, obj in vars(module).items():
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isclass(obj) or inspect.isfunction(obj):
            members.append((name, obj))
    for _, obj in sorted(members, key=lambda m: m[0]):
        docs.append(inspect.getdoc(obj) or "")
        if inspect.isclass(obj):
            for attr, member in sorted(vars(obj).items()):
                if not attr.startswith("_") and inspect.isfunction(member):
                    docs.append(inspect.getdoc(member) or "")
    return [d for d in docs if len(d) >= MIN_DOC_CHARS]


def build_corpus_records(
    modules: Sequence[str] = CORPUS_MODULES, seen: Iterable[str] = ()
) -> list[str]:
    """The corpus: one record per docstring, deduplicated, deterministic;
    none of the docstrings in `seen`."""
    seen = set(seen)
    records = []
    for name in modules:
        try:
            module = importlib.import_module(name)
        except ImportError:  # e.g. a Python built without sqlite3 or tkinter
            continue
        for doc in _public_docs(module):
            if doc not in seen:
                seen.add(doc)
                records.append(doc)
    return records


def train_tokenizer(records: list[str], out_dir: Path) -> None:
    """Train a byte-level BPE tokenizer in the HF format upstream loads."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[BOS_TOKEN, EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(records, trainer=trainer)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = {
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "model_max_length": 131072,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def _build(root: Path) -> None:
    records = build_corpus_records()
    staging = Path(tempfile.mkdtemp(prefix=root.name + ".", dir=root.parent))
    (staging / "dataset").mkdir()
    (staging / "tokenizer").mkdir()
    lines = "".join(json.dumps({"text": r}) + "\n" for r in records)
    (staging / "dataset" / "data.jsonl").write_text(lines)
    train_tokenizer(records, staging / "tokenizer")
    meta = {
        "recipe_version": RECIPE_VERSION,
        "python": sys.version.split()[0],
        "num_records": len(records),
        "corpus_chars": sum(len(r) for r in records),
        "corpus_sha256": hashlib.sha256(lines.encode()).hexdigest(),
    }
    (staging / "meta.json").write_text(json.dumps(meta, indent=2))
    try:
        staging.rename(root)  # atomic; a concurrent builder may have won
    except OSError:
        if not (root / "meta.json").exists():
            raise


def _build_validation(root: Path) -> None:
    """The held-out set, added to a built cache (atomically)."""
    corpus = (root / "dataset" / "data.jsonl").read_text().splitlines()
    seen = {json.loads(line)["text"] for line in corpus}
    records = build_corpus_records(VALIDATION_MODULES, seen)
    staging = Path(tempfile.mkdtemp(prefix="validation.", dir=root))
    lines = "".join(json.dumps({"text": r}) + "\n" for r in records)
    (staging / "data.jsonl").write_text(lines)
    try:
        staging.rename(root / "validation")
    except OSError:  # a concurrent builder won
        shutil.rmtree(staging)
        if not (root / "validation" / "data.jsonl").exists():
            raise


def ensure_default_assets() -> DefaultAssets:
    """Build the assets once (atomically) and return their paths."""
    root = cache_root()
    if not (root / "meta.json").exists():
        root.parent.mkdir(parents=True, exist_ok=True)
        _build(root)
    if not (root / "validation").exists():
        _build_validation(root)
    meta = json.loads((root / "meta.json").read_text())
    return DefaultAssets(
        root=root,
        dataset_path=root / "dataset",
        validation_path=root / "validation",
        tokenizer_path=root / "tokenizer",
        corpus_sha256=meta["corpus_sha256"],
    )
