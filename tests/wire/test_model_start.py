"""Loading a ``huggingface`` or ``path`` model at start (rljob_wire.model.load_from), with the real transformers and
huggingface_hub: what cannot be loaded is a StartFailure naming the field and its value, permanent or transient; a Hub
that cannot be reached is tried again with back-off."""

from __future__ import annotations

import httpx
import pytest
from huggingface_hub import constants as hub
from huggingface_hub.errors import LocalEntryNotFoundError
from huggingface_hub.utils import _http as hub_http

from portutil import free_port
from rljob_api.spec import ModelSpec
from rljob_api.start_failure import StartFailure
from rljob_wire import model as wire_model
from rljob_wire.model import build_tokenizer, load_from

QWEN = ModelSpec(source="huggingface", name="Qwen/Qwen2.5-0.5B-Instruct")


def failure(call) -> StartFailure:
    with pytest.raises(StartFailure) as raised:
        call()
    return raised.value


def test_a_path_that_is_no_directory_is_permanent_and_named(tmp_path):
    spec = ModelSpec(source="path", path=str(tmp_path / "nope"))
    said = failure(lambda: build_tokenizer(spec))
    assert said.permanent
    assert said.message == (f"spec.model.path: {str(tmp_path / 'nope')!r}: no such directory in this container: mount "
                            "the model there (a volume, spec.model.volume or the pod templates), or use "
                            "spec.model.source: huggingface")


def test_a_directory_without_a_tokenizer_is_permanent_and_named(tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=64, num_attention_heads=2, num_hidden_layers=1, intermediate_size=128,
                vocab_size=14).save_pretrained(tmp_path)
    said = failure(lambda: build_tokenizer(ModelSpec(source="path", path=str(tmp_path))))
    assert said.permanent
    assert said.message.startswith(f"spec.model.path: {str(tmp_path)!r}: the directory has no loadable tokenizer (")
    assert said.message.endswith("): it must hold a model saved with save_pretrained (config.json, *.safetensors, "
                                 "the tokenizer's files)")


def test_a_hub_model_not_in_the_cache_with_the_hub_switched_off_is_permanent(tmp_path, monkeypatch):
    """HF_HUB_OFFLINE=1 (huggingface_hub reads it at import: its constant is set here as the env would) and an empty
    cache: no try reaches a network."""
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))
    said = failure(lambda: build_tokenizer(QWEN))
    assert said.permanent
    assert said.message == (
        f"spec.model.name: 'Qwen/Qwen2.5-0.5B-Instruct': no tokenizer in the pod's Hugging Face cache ({tmp_path}/hub) "
        "and HF_HUB_OFFLINE is set, so nothing can be downloaded: put the model in that cache (a volume at HF_HOME in "
        "the pod templates), or mount it and use spec.model.source: path")


def test_a_hub_that_cannot_be_reached_is_transient(tmp_path, monkeypatch):
    """A real connection refused: the Hub's endpoint on a local port nothing listens on (huggingface_hub's own five
    retries of each request without their sleeps; no retry of rljob's own)."""
    endpoint = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setattr(hub, "ENDPOINT", endpoint)
    monkeypatch.setattr(hub, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hub_http.time, "sleep", lambda seconds: None)
    monkeypatch.setattr(wire_model, "HUB_RETRY_S", 0.0)
    said = failure(lambda: build_tokenizer(QWEN))
    assert not said.permanent
    assert said.message.startswith(
        f"spec.model.name: 'Qwen/Qwen2.5-0.5B-Instruct': no tokenizer in the pod's Hugging Face cache ({tmp_path}/hub) "
        "and the Hugging Face Hub cannot be reached (")
    assert "Connection refused" in said.message
    assert said.message.endswith("): the pod is retried; without network, put the model in that cache and set "
                                 "HF_HUB_OFFLINE=1, or mount it and use spec.model.source: path (1 try in 0 s)")


def test_transient_failures_are_tried_again_with_growing_waits_until_one_loads(caplog):
    errors = [LocalEntryNotFoundError("cannot find the requested files"), LocalEntryNotFoundError("again")]
    errors[0].__cause__ = httpx.ConnectError("[Errno 111] Connection refused")
    errors[1].__cause__ = httpx.ReadTimeout("timed out")
    waits: list[float] = []

    def load():
        if errors:
            raise errors.pop(0)
        return "tokenizer"

    assert load_from(QWEN, "tokenizer", load, retry_s=60, sleep=waits.append) == "tokenizer"
    assert len(waits) == 2 and 1.0 <= waits[0] <= 2.0 and 2.0 <= waits[1] <= 4.0, waits
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 2 and all(w.startswith("spec.model.name: 'Qwen/Qwen2.5-0.5B-Instruct': no tokenizer") for w in warned)
    assert "(ReadTimeout: timed out)" in warned[1]


def test_what_the_hub_does_not_have_is_permanent():
    response = httpx.Response(404, request=httpx.Request("GET", "https://huggingface.co/api/models/nobody/nothing"))
    from huggingface_hub.errors import RepositoryNotFoundError

    missing = RepositoryNotFoundError("404 Client Error. Repository Not Found for url", response=response)
    waits: list[float] = []
    said = failure(lambda: load_from(ModelSpec(source="huggingface", name="nobody/nothing", revision="v2"), "model",
                                     lambda: _raise(missing), sleep=waits.append))
    assert said.permanent and waits == []
    assert said.message == (
        "spec.model.name: 'nobody/nothing' (spec.model.revision 'v2'): the Hugging Face Hub has no loadable model for "
        "it (RepositoryNotFoundError: 404 Client Error. Repository Not Found for url): check the name, "
        "spec.model.revision and, for a private or gated model, spec.hfTokenSecretRef")
    overloaded = httpx.Response(503, request=httpx.Request("GET", "https://huggingface.co/api/models/a/b"))
    from huggingface_hub.errors import HfHubHTTPError

    assert not wire_model.start_failure(QWEN, HfHubHTTPError("503 Server Error", response=overloaded), "model").permanent


def _raise(error: BaseException):
    raise error
