"""The researcher SDK: submit jobs, follow them, fetch results.

from idlegrid import Client
client = Client("http://127.0.0.1:8000", token="igr_...")
job = client.submit_embeddings(["a text", "another"])
job.wait(progress=True)
vectors = job.result()          # numpy float32 array, one row per text, input order
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from idlegrid.states import TERMINAL_JOB_STATES
from idlegrid.training import gguf_import, hf_folder

log = logging.getLogger(__name__)

TERMINAL = frozenset(state.value for state in TERMINAL_JOB_STATES)


TRAINING_KIND = "diloco-train"
# Jobs whose progress shows in tokens (shards cut by a token budget).
TOKEN_KIND = "llm-generate"
MAX_WAIT_S = 60.0  # the coordinator's longest long poll of a job
# Blobs larger than this upload in chunks (resumable); smaller ones in one request.
CHUNKED_ABOVE = 8 * 1024 * 1024
UPLOAD_RETRIES = 5  # failed chunks in a row before an upload gives up


class IdlegridError(RuntimeError):
    """An error answered by the coordinator (status, code and its message)."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message


class JobFailed(IdlegridError):
    pass


class Unreachable(IdlegridError):
    """The coordinator did not answer: not running, a wrong URL, or no network."""

    def __init__(self, server: str, reason: str) -> None:
        super().__init__(0, "unreachable", f"cannot reach the coordinator at {server}: {reason}")
        self.server = server


class Client:
    """A connection to one coordinator with one researcher token."""

    def __init__(
        self,
        server: str | None = None,
        token: str | None = None,
        *,
        timeout: float = 120.0,
        transport: httpx.BaseTransport | None = None,
        upload_progress: Callable[[str, int, int], None] | None = None,
    ) -> None:
        """`upload_progress(name, bytes_sent, size)`: called as a chunked upload goes."""
        self.server = server or os.environ.get("IDLEGRID_SERVER") or "http://127.0.0.1:8000"
        token = token or os.environ.get("IDLEGRID_TOKEN")
        if not token:
            raise ValueError("a token is needed: pass token= or set IDLEGRID_TOKEN")
        self._http = httpx.Client(
            base_url=self.server.rstrip("/"),
            timeout=timeout,
            transport=transport,
            headers={"Authorization": f"Bearer {token}"},
        )
        self.upload_progress = upload_progress

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise Unreachable(self.server, str(exc) or type(exc).__name__) from exc
        if response.status_code >= 400:
            raise _error(response)
        return response

    def read_timeout(self) -> float:
        """Seconds a request may wait for its answer (inf: no limit)."""
        read = self._http.timeout.read
        return float("inf") if read is None else float(read)

    def request_status(self, method: str, path: str) -> int:
        """The status of a request whose answer may be an error (e.g. HEAD of a blob)."""
        try:
            return self._http.request(method, path).status_code
        except httpx.TransportError as exc:
            raise Unreachable(self.server, str(exc) or type(exc).__name__) from exc

    # -- blobs -----------------------------------------------------------------------------

    def upload(self, data: bytes, *, name: str = "") -> str:
        """Upload bytes as a content-addressed blob (skipped if already there). Past
        `CHUNKED_ABOVE` bytes it goes in chunks (`POST /v1/uploads`), each retried
        where it broke off, so a large model survives a dropped connection; an upload
        of the same bytes that an earlier run left unfinished goes on from there."""
        blob_hash = hashlib.sha256(data).hexdigest()
        if self.request_status("HEAD", f"/v1/blobs/{blob_hash}") == 200:
            return blob_hash
        if len(data) <= CHUNKED_ABOVE:
            self.request("PUT", f"/v1/blobs/{blob_hash}", content=data)
        else:
            self._upload_chunks(blob_hash, data, name)
        return blob_hash

    def _upload_chunks(self, blob_hash: str, data: bytes, name: str) -> None:
        body = {"hash": blob_hash, "size": len(data), "name": name}
        label = name or blob_hash[:12]
        state: dict[str, Any] | None = None
        failures = 0
        while state is None or not state["done"]:
            try:
                if state is None:  # where to go on from: 0, or what arrived before
                    state = self.request("POST", "/v1/uploads", json=body).json()
                    continue
                if self.upload_progress is not None:
                    self.upload_progress(label, state["received"], len(data))
                offset = state["received"]
                chunk = data[offset : offset + state["chunk_size"]]
                path, where = f"/v1/uploads/{state['id']}", {"offset": offset}
                state = self.request("PUT", path, params=where, content=chunk).json()
                failures = 0
            except IdlegridError as exc:
                if not _resumable(exc) or failures >= UPLOAD_RETRIES:
                    raise
                failures += 1
                time.sleep(min(2.0**failures, 30.0))
                state = None
        if self.upload_progress is not None:
            self.upload_progress(label, len(data), len(data))

    def download(self, blob_hash: str) -> bytes:
        data = self.request("GET", f"/v1/blobs/{blob_hash}").content
        if hashlib.sha256(data).hexdigest() != blob_hash:
            raise IdlegridError(0, "corrupt", f"blob {blob_hash} did not match its hash")
        return data

    # -- jobs ------------------------------------------------------------------------------

    def submit(
        self,
        kind: str,
        *,
        inputs: Mapping[str, bytes] | None = None,
        params: Mapping[str, Any] | None = None,
        replication: int | None = None,
        priority: int = 0,
    ) -> Job:
        """Upload inputs and submit a job of any built-in kind."""
        refs = {name: self.upload(data, name=name) for name, data in (inputs or {}).items()}
        body: dict[str, Any] = {
            "kind": kind,
            "inputs": refs,
            "params": dict(params or {}),
            "priority": priority,
        }
        if replication is not None:
            body["replication"] = replication
        info = self.request("POST", "/v1/jobs", json=body).json()
        job = Job(self, info["id"], info)
        for warning in job.warnings:
            # Logged, not warnings.warn: it shows on stderr in a plain script or notebook
            # (logging's last-resort handler) and says it again for every job.
            log.warning("job %s: %s", job.id, warning)
        return job

    def submit_embeddings(
        self,
        texts: Iterable[str] | str | Path,
        *,
        shard_size: int | None = None,
        batch_size: int | None = None,
        replication: int | None = None,
        priority: int = 0,
    ) -> Job:
        """Embed texts (a list, or a path to a JSONL file) with all-MiniLM-L6-v2."""
        if isinstance(texts, str | Path):
            data = Path(texts).read_bytes()
        else:
            data = "".join(json.dumps(t, ensure_ascii=False) + "\n" for t in texts).encode()
        params = {
            k: v
            for k, v in {"shard_size": shard_size, "batch_size": batch_size}.items()
            if v is not None
        }
        return self.submit(
            "embed-text",
            inputs={"texts": data},
            params=params,
            replication=replication,
            priority=priority,
        )

    def submit_onnx(
        self,
        model: bytes | str | Path,
        inputs: Mapping[str, np.ndarray] | np.ndarray | bytes | str | Path,
        *,
        outputs: Iterable[str] | None = None,
        batch_size: int | None = None,
        shard_size: int | None = None,
        providers: Iterable[str] | None = None,
        tolerances: Mapping[str, Mapping[str, float | None]] | None = None,
        replication: int | None = None,
        priority: int = 0,
    ) -> Job:
        """Run an ONNX model over arrays: {input name: array} (rows first), one array for a
        one-input model, or a .npy / safetensors file. `job.result()` is {output: array},
        rows in input order."""
        data = _dataset_bytes(inputs)
        params = _onnx_params(outputs, batch_size, shard_size, providers, tolerances)
        return self.submit(
            "onnx-infer",
            inputs={"model": _read(model), "data": data},
            params=params,
            replication=replication,
            priority=priority,
        )

    def submit_images(
        self,
        model: bytes | str | Path,
        image_paths: Iterable[str | Path],
        *,
        preprocess: Mapping[str, Any],
        outputs: Iterable[str] | None = None,
        batch_size: int | None = None,
        shard_size: int | None = None,
        providers: Iterable[str] | None = None,
        tolerances: Mapping[str, Mapping[str, float | None]] | None = None,
        replication: int | None = None,
        priority: int = 0,
    ) -> Job:
        """Run an ONNX model over JPEG/PNG files, decoded on the workers as `preprocess`
        says (crop, resize, mean, std, layout, color). `job.result()` is {output: array}
        with one row per image, in the order of `image_paths`."""
        from idlegrid.kinds.onnx.data import zip_files

        params = _onnx_params(outputs, batch_size, shard_size, providers, tolerances)
        params["preprocess"] = dict(preprocess)
        return self.submit(
            "onnx-infer",
            inputs={"model": _read(model), "data": zip_files([Path(p) for p in image_paths])},
            params=params,
            replication=replication,
            priority=priority,
        )

    def train(
        self,
        model: str | Path,
        *,
        dataset: str | Path | np.ndarray | bytes,
        lora: Mapping[str, Any] | None = None,
        params: Mapping[str, Any] | None = None,
        replication: int | None = None,
        priority: int = 0,
    ) -> TrainingJob:
        """Fine-tune (or continue pretraining) a Hugging Face causal LM with DiLoCo.

        `model`: a folder (config.json, model.safetensors, tokenizer.json) or a .gguf
        file. `dataset`: a text file's path (tokenized with the model's tokenizer), token
        ids (an array, or a .safetensors file with `tokens`), or a dataset blob.
        `lora`: train low-rank adapters only, e.g. {"rank": 8, "targets": ["q_proj",
        "v_proj"]}. `params`: further diloco-train settings (rounds, workers, inner, ...).
        `job.save(out_dir)` writes the trained model as a folder transformers loads.
        """
        base = gguf_import.load_model(Path(model))
        settings = {"architecture": "hf-causal-lm", **dict(params or {})}
        if lora is not None:
            settings["model"] = {**settings.get("model", {}), "lora": dict(lora)}
        job = self.submit(
            TRAINING_KIND,
            inputs={"model": hf_folder.model_blob(base), "dataset": _training_data(dataset)},
            params=settings,
            replication=replication,
            priority=priority,
        )
        source = Path(model)
        return TrainingJob(self, job.id, job._info, base=base,
                           base_path=source if source.is_dir() else None)  # fmt: skip

    def generate(
        self,
        model: bytes | str | Path,
        prompts: Iterable[str | Mapping[str, Any]] | str | Path,
        *,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        stop: Iterable[str] | None = None,
        seed: int | None = None,
        token_budget: int | None = None,
        replication: int | None = None,
        priority: int = 0,
    ) -> Job:
        """Generate text with a GGUF model (bytes or a path) over prompts: strings, objects
        (`{"prompt": ...}` or `{"messages": [...]}`, an optional `"seed"`), or a path to a
        JSON Lines file of those objects, or of OpenAI Batch API input lines (each with
        its own settings). `temperature` 0 (the default) is greedy. `job.result()` is one
        dict per prompt, in order: text, token ids, each token's log-probability,
        finish_reason ("stop", "length", or "error" with `error` saying why); for a batch
        file, OpenAI Batch API output lines (`custom_id`, `response`, `error`)."""
        if isinstance(prompts, str | Path):
            data = Path(prompts).read_bytes()
        else:
            records = [{"prompt": p} if isinstance(p, str) else dict(p) for p in prompts]
            data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()
        settings = {
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            "stop": list(stop) if stop is not None else None,
            "seed": seed,
            "token_budget": token_budget,
        }
        return self.submit(
            "llm-generate",
            inputs={"model": _read(model), "prompts": data},
            params={k: v for k, v in settings.items() if v is not None},
            replication=replication,
            priority=priority,
        )

    def job(self, job_id: int) -> Job:
        return Job(self, job_id)

    def jobs(self, *, limit: int = 50) -> list[dict[str, Any]]:
        return list(self.request("GET", "/v1/jobs", params={"limit": limit}).json())

    def nodes(self) -> list[dict[str, Any]]:
        return list(self.request("GET", "/v1/nodes").json())

    def tokens(
        self, *, account: str | None = None, all_accounts: bool = False, revoked: bool = False
    ) -> list[dict[str, Any]]:
        """Tokens (never their secrets): yours, or an account's or everyone's for admins."""
        params: dict[str, Any] = {"all": all_accounts, "revoked": revoked}
        if account:
            params["account"] = account
        return list(self.request("GET", "/v1/tokens", params=params).json())

    def revoke_token(self, token_id: int) -> dict[str, Any]:
        return dict(self.request("DELETE", f"/v1/tokens/{token_id}").json())

    def create_token(
        self, *, kind: str = "api", label: str = "", account: str | None = None
    ) -> dict[str, Any]:
        body = {"kind": kind, "label": label, "account": account}
        return dict(self.request("POST", "/v1/tokens", json=body).json())


class Job:
    """A submitted job: poll it, wait for it, fetch its result."""

    def __init__(self, client: Client, job_id: int, info: dict[str, Any] | None = None) -> None:
        self.client = client
        self.id = job_id
        self._info = info

    def __repr__(self) -> str:
        return f"Job(id={self.id}, state={self.state!r})"

    def info(self, *, shards: bool = False, wait_s: float = 0.0) -> dict[str, Any]:
        """The job's status (`shards`: with each shard's). `wait_s` (up to 60): a long
        poll, answered when the job ends or its progress moves, or after `wait_s`."""
        params: dict[str, str] = {"shards": "true" if shards else "false"}
        if wait_s > 0:
            params["wait_s"] = f"{wait_s:.3f}"
        self._info = dict(self.client.request("GET", f"/v1/jobs/{self.id}", params=params).json())
        if not shards:
            self._info.pop("shards", None)
        return self._info

    @property
    def warnings(self) -> list[str]:
        """What the coordinator warned of at submission (why the job may wait), if any."""
        return list((self._info or {}).get("warnings") or [])

    @property
    def state(self) -> str:
        return str((self._info or self.info())["state"])

    def cancel(self) -> dict[str, Any]:
        self._info = dict(self.client.request("POST", f"/v1/jobs/{self.id}/cancel").json())
        return self._info

    def resubmit(self) -> Job:
        """A new job of this failed (or cancelled) job's shards that did not complete."""
        info = dict(self.client.request("POST", f"/v1/jobs/{self.id}/resubmit").json())
        return Job(self.client, int(info["id"]), info)

    def wait(
        self, *, progress: bool = False, timeout: float | None = None, poll_s: float = 20.0
    ) -> dict[str, Any]:
        """Block until the job ends; raise JobFailed if it failed or was cancelled.

        It long-polls the coordinator (`GET /v1/jobs/{id}?wait_s=`), which answers as
        soon as the job ends or moves on: no sleeping between polls, so the wait ends
        when the job does. `poll_s`: the longest one poll (at most 60 s).
        `progress`: show a bar (one line per change when stderr is not a terminal), with
        the reason beside it whenever the job waits for something the fleet lacks.
        """
        from idlegrid.cli.progress import JobProgress

        deadline = None if timeout is None else time.monotonic() + timeout
        bar: JobProgress | None = None
        if progress:
            kind = (self._info or self.info())["kind"]
            bar = JobProgress(
                self.id,
                metrics=self.metrics if kind == TRAINING_KIND else None,
                tokens=self.tokens if kind == TOKEN_KIND else None,
            )
        longest = max(0.0, min(poll_s, MAX_WAIT_S, self.client.read_timeout() / 2))
        try:
            info = self.info()
            while True:
                if bar is not None:
                    bar.update(info)
                if info["state"] in TERMINAL:
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"job {self.id} still {info['state']} after {timeout} s")
                wait_s = longest if left is None else min(longest, left)
                asked = time.monotonic()
                seen = (info["state"], info["shards_done"])
                info = self.info(wait_s=wait_s)
                if (info["state"], info["shards_done"]) == seen and (
                    time.monotonic() - asked < wait_s / 2
                ):
                    # Unchanged, and answered early: a coordinator without long polls.
                    time.sleep(min(0.5, wait_s))
        finally:
            if bar is not None:
                bar.close()
        if info["state"] != "completed":
            raise JobFailed(0, info["state"], info.get("error") or f"job {self.id} {info['state']}")
        return info

    def tokens(self) -> tuple[int, int]:
        """A generation job's progress in tokens (prompt plus max_tokens, the unit its
        shards are cut by): done, counting the running shards' progress, and in all."""
        info = self.info(shards=True)
        done = sum(
            s["items"] * (1.0 if s["state"] == "done" else s["progress"])
            for s in info["shards"] or []
        )
        return int(done), int(info["items_total"])

    def metrics(self) -> dict[str, Any]:
        """A training job's per-round metrics: train and eval loss, bytes, time, nodes."""
        return dict(self.client.request("GET", f"/v1/jobs/{self.id}/metrics").json())

    def result_bytes(self) -> bytes:
        return self.client.request("GET", f"/v1/jobs/{self.id}/result").content

    def result(self) -> Any:
        """The job's result: a numpy array for embed-text, {output name: array} for
        onnx-infer, {parameter name: array} (the trained weights) for diloco-train, a list
        of dicts for llm-generate (one per prompt), parsed JSON for JSON kinds."""
        response = self.client.request("GET", f"/v1/jobs/{self.id}/result")
        media = response.headers.get("content-type", "")
        if "npy" in media:
            return np.load(io.BytesIO(response.content), allow_pickle=False)
        if "safetensors" in media:
            from safetensors.numpy import load

            return dict(load(response.content))
        if "ndjson" in media:  # one JSON object per line (llm-generate)
            return [json.loads(line) for line in response.text.splitlines() if line.strip()]
        if "json" in media:
            return response.json()
        return response.content


class TrainingJob(Job):
    """A training job of a researcher's model, which `save` writes back as a folder."""

    def __init__(
        self,
        client: Client,
        job_id: int,
        info: dict[str, Any] | None,
        *,
        base: hf_folder.HFModel,
        base_path: Path | None = None,
    ) -> None:
        super().__init__(client, job_id, info)
        self.base = base
        self.base_path = base_path

    def save(self, folder: str | Path) -> Path:
        """Write the trained model as the job asked: the submitted folder (tokenizer, chat
        template, generation config) with trained weights, LoRA adapters merged in; or,
        with `lora={"result": "adapter", ...}`, a PEFT adapter folder for the base."""
        from safetensors.numpy import load

        from idlegrid.training.hf_models import LoraSettings

        lora = ((self._info or self.info())["params"].get("model") or {}).get("lora")
        named = load(self.result_bytes())
        settings = None if lora is None else LoraSettings.model_validate(lora)
        hf_folder.write_result(Path(folder), self.base, named, settings, base_path=self.base_path)
        return Path(folder)


def _training_data(dataset: str | Path | np.ndarray | bytes) -> bytes:
    if isinstance(dataset, bytes):
        return dataset
    if isinstance(dataset, np.ndarray):
        return hf_folder.token_dataset_blob(dataset)
    path = Path(dataset)
    if path.suffix == ".safetensors":
        return path.read_bytes()
    return hf_folder.text_dataset_blob(path.read_text(encoding="utf-8"))


def _read(source: bytes | str | Path) -> bytes:
    return source if isinstance(source, bytes) else Path(source).read_bytes()


def _dataset_bytes(inputs: Mapping[str, np.ndarray] | np.ndarray | bytes | str | Path) -> bytes:
    """The onnx-infer `data` blob: safetensors of named arrays, or .npy of one array."""
    if isinstance(inputs, bytes | str | Path):
        return _read(inputs)
    if isinstance(inputs, np.ndarray):
        buffer = io.BytesIO()
        np.save(buffer, inputs, allow_pickle=False)
        return buffer.getvalue()
    from safetensors.numpy import save

    return save({name: np.ascontiguousarray(array) for name, array in inputs.items()})


def _onnx_params(
    outputs: Iterable[str] | None,
    batch_size: int | None,
    shard_size: int | None,
    providers: Iterable[str] | None,
    tolerances: Mapping[str, Mapping[str, float | None]] | None,
) -> dict[str, Any]:
    given = {
        "outputs": list(outputs) if outputs is not None else None,
        "batch_size": batch_size,
        "shard_size": shard_size,
        "providers": list(providers) if providers is not None else None,
        "tolerances": {k: dict(v) for k, v in tolerances.items()} if tolerances else None,
    }
    return {key: value for key, value in given.items() if value is not None}


def _resumable(exc: IdlegridError) -> bool:
    """A chunk that failed on the way (no answer, a chunk another request sent first,
    a coordinator error) is sent again from where the upload stands; a refusal is not."""
    return isinstance(exc, Unreachable) or exc.code == "wrong_offset" or exc.status >= 500


def _error(response: httpx.Response) -> IdlegridError:
    try:
        body = response.json()
        return IdlegridError(
            response.status_code, body.get("error", "error"), body.get("message", response.text)
        )
    except ValueError:
        return IdlegridError(response.status_code, "error", response.text[:500])
