"""The HTTP API: every route in one table, and the thin handlers it names.

Handlers take (services, request) and return JSON-able data or a Reply.
They raise localrt.errors exceptions; they never build error responses.
If you add a route, also document it in man/localrt-api.7 (tests/test_man.py
checks) and its CLI command in man/localrt.1; its request schema goes in schemas/.
Each dialect's routes (OpenAI's, Anthropic's, the Responses API and Ollama's, under
/api/) are thin: the handler hands the body and the native services the dialect uses
to its module under localrt.dialects. Ollama's and Anthropic's errors take their
shape (DIALECTS). Each handler's docstring's first line is its
route's summary in GET /openapi.json: say what the route does.
"""

from __future__ import annotations

import threading

from localrt import __version__, multipart, web
from localrt.dialects import anthropic, ollama, ollama_models, openai, responses
from localrt.errors import Conflict, InvalidField, NotFound
from localrt.metrics import CONTENT_TYPE
from localrt.models import roles
from localrt.models.ids import check_id
from localrt.routing import STREAM_HEADERS, Dialect, Reply, Request, Route
from localrt.services import Services


def healthz(services: Services, request: Request):
    """Liveness: answers without touching any engine."""
    return {"status": "ok", "version": __version__}


def metrics(services: Services, request: Request):
    """Prometheus metrics in the text exposition format 0.0.4.

    Answers without touching any engine."""
    text = services.metrics.render().encode("utf-8")
    return Reply([text], content_type=CONTENT_TYPE,
                 headers=[("Content-Length", str(len(text))), ("Cache-Control", "no-store")])


def openapi_document(services: Services, request: Request):
    """This API as an OpenAPI 3.1 document, made from the route table and schemas/."""
    from localrt import openapi

    return openapi.document(ROUTES, DIALECTS)


def get_configs(services: Services, request: Request):
    """The whole Config: CORS, proxy, SSL flags and the hub token."""
    return services.config.get()


def patch_configs(services: Services, request: Request):
    """Change only the given Config fields; the others keep their values."""
    config = services.config.update(request.body)
    return {"config": config, "message": "Configuration updated successfully"}


def stop_server(services: Services, request: Request):
    """Stop the server gracefully, once this reply has been sent."""
    if services.shutdown is None:
        raise Conflict("This server was not started by `localrt start` and cannot stop itself")
    shutdown = services.shutdown
    return Reply({"message": "Server is shutting down"},
                 after=lambda: threading.Thread(target=shutdown, daemon=True).start())


# --- the chat page (localrt.web) ----------------------------------------------------


def web_page(services: Services, request: Request):
    """The chat page: a person's way to chat, pull and start models in a browser.

    Served without a key (it holds none); what it asks of the API needs one."""
    return _web_file(services, web.INDEX)


def web_file(services: Services, request: Request):
    """One of the chat page's files: its JavaScript modules, style sheet and icon."""
    return _web_file(services, request.params["name"])


def _web_file(services: Services, name: str) -> Reply:
    if not services.settings["webUi"]:
        raise NotFound("The chat page is turned off (webUi: false in the settings file)")
    data, media_type = web.read(name)
    return Reply([data], content_type=media_type,
                 headers=[*web.HEADERS, ("Content-Length", str(len(data)))])


# --- models and downloads ----------------------------------------------------------


def list_models(services: Services, request: Request):
    """The downloaded, imported and remote models, in OpenAI's list shape."""
    return {"object": "list",
            "data": [_with_status(services, m) for m in services.registry.list()]}


def _with_status(services: Services, record: dict) -> dict:
    """A model's record with its status: "running", else the registry's ("downloaded", or
    "missing", "damaged" or "invalid" for files not as registered: Registry._record), or
    "invalid" for a file a child could not load (its `vetting` says why); a remote
    model's with its upstreams' health (localrt.inference.remote)."""
    running = services.scheduler.is_running(record["id"])
    status = "running" if running else record.get("status", "downloaded")
    if status == "downloaded" and (record.get("vetting") or {}).get("ok") is False:
        status = "invalid"
    return services.remotes.annotate({**record, "status": status})


def _path_model(request: Request) -> str:
    """The {model_id} of the path; a 400 naming `model` for an id no model can have."""
    return check_id(request.params["model_id"])


def get_model(services: Services, request: Request):
    """One model's record: its definition, files, size and status."""
    return _with_status(services, services.registry.get(_path_model(request)))


def delete_model(services: Services, request: Request):
    """Delete a model that is not running: its files and its definition."""
    model_id = _path_model(request)
    with services.scheduler.not_running(model_id):
        services.registry.remove(model_id)
    return {"message": f"Model {model_id} removed", "id": model_id, "object": "model",
            "deleted": True}


def update_model(services: Services, request: Request):
    """Change a model's stored parameters and model.yml fields, or a remote's upstreams.

    The fields are schemas/model-update.json's."""
    model_id = _path_model(request)
    beside = roles.given(request.body)  # paths: files of a GGUF model (never a remote's)
    changes = {k: v for k, v in request.body.items() if k not in roles.KEYS}
    if beside:
        model = services.imports.set_files(model_id, beside, changes)
    elif "upstreams" in changes:
        model = services.remotes.update(model_id, request.body)
    else:
        model = services.registry.update(model_id, changes)
    message = f"Model {model['id']} updated"
    if beside and services.scheduler.is_running(model_id):
        message += "".join(role.running_note for role in beside)
    return {"message": message, "model": _with_status(services, model)}


def add_remote_model(services: Services, request: Request):
    """Register a remote model: one served by OpenAI-compatible servers (its upstreams)."""
    model = _with_status(services, services.remotes.add(request.body))
    return {"message": f"Model {model['id']} added: {model['upstreams_healthy']} of "
                       f"{model['upstreams_total']} upstreams healthy", "model": model}


def pull_model(services: Services, request: Request):
    """Pull the model the path names: start a background download, or say it is there."""
    return services.pulls.pull(_path_model(request))


def pull_model_body(services: Services, request: Request):
    """Pull the model the body names: start a background download, or say it is there.

    The body is cortex's {"model", "file"?, "id"?, "name"?}."""
    body = request.body
    return services.pulls.pull(body["model"], body.get("file"), body.get("id"),
                               body.get("name"))


def model_variants(services: Services, request: Request):
    """What a pull of a built-in name or a hub repository can choose, with sizes."""
    return services.pulls.variants(request.body["model"])


def list_pulls(services: Services, request: Request):
    """Download tasks with their progress."""
    return {"object": "list", "data": services.downloads.list()}


def cancel_pull(services: Services, request: Request):
    """Stop a download; its part files stay so a new pull resumes."""
    task = services.downloads.cancel(request.body["taskId"])
    return {"message": f"Download {task['id']} is stopping", "task": task}


def import_model(services: Services, request: Request):
    """Register a local GGUF file or ONNX model folder, linked or copied in.

    The body is localrt's {"path", "id"?} or cortex's {"model", "modelPath"}."""
    body = request.body
    cortex = "modelPath" in body  # the schema holds a body with model or modelPath to it
    model = services.imports.import_file(body["modelPath" if cortex else "path"],
                                         body.get("model" if cortex else "id"),
                                         body.get("option", "symlink"), body.get("name"),
                                         cortex=cortex, beside=roles.given(body))
    return {"message": f"Model {model['id']} imported", "model": _with_status(services, model)}


# --- running models and chat ------------------------------------------------------


def _model_of(request: Request) -> str:
    """The model id of a start or stop: in the path, or as the body's "model"."""
    given = (request.body or {}).get("model")
    model_id = request.params.get("model_id", given)
    if model_id is None:
        raise InvalidField("Missing required field 'model'", param="model")
    check_id(model_id)
    if given is not None and given != model_id:
        raise InvalidField(f"Invalid field 'model': {given!r} is not the model in the path, "
                           f"{model_id!r}", param="model")
    return model_id


def start_model(services: Services, request: Request):
    """Load a model with its stored parameters and these start options."""
    model_id = _model_of(request)
    options = {k: v for k, v in request.body.items() if k != "model"}
    if _remote(services, model_id):
        return services.remotes.started(model_id, options)
    running, started = services.scheduler.start(model_id, options)
    message = f"Model {model_id} started successfully"
    if not started:
        message = f"Model {model_id} is already running"
        other = sorted(k for k, v in options.items() if running.options.get(k) != v)
        if other:
            message += (f", with other {', '.join(other)}; stop it first to start it with "
                        f"these options")
    return {"message": message, "model": model_id, "engine": running.engine,
            "options": running.options, "alreadyRunning": not started}


def stop_model(services: Services, request: Request):
    """Unload a model and free its memory."""
    model_id = _model_of(request)
    if _remote(services, model_id):
        return services.remotes.stopped(model_id)
    services.scheduler.stop(model_id)
    return {"message": f"Model {model_id} stopped successfully", "model": model_id}


def _remote(services: Services, model_id: str) -> bool:
    """Whether a registered model is remote: nothing loads, its upstreams serve it."""
    return services.registry.has(model_id) and \
        services.remotes.serves(services.registry.get(model_id))


def models_status(services: Services, request: Request):
    """The running models and remote ones with their upstreams, and the machine's hardware.

    What `localrt ps` shows."""
    return {"object": "list", "data": services.scheduler.status() + services.remotes.status(),
            "hardware": services.engines.hardware.status()}


def hardware(services: Services, request: Request):
    """This machine's CPU, OS, RAM, storage and GPUs, in cortex's shape (MiB).

    GPUs are NVIDIA ones (NVML) and Vulkan devices, read by a child process; none is
    an empty list."""
    return services.engines.hardware.cortex(services.settings.data_dir)


def chat_completions(services: Services, request: Request):
    """OpenAI's chat completion, streamed as Server-Sent Events or not."""
    return _streamed(openai.chat(services.chats, request.body, request.disconnected))


def completions(services: Services, request: Request):
    """OpenAI's text completion (the legacy API), streamed as Server-Sent Events or not."""
    return _streamed(openai.completion(services.completions, request.body,
                                       request.disconnected))


def embeddings(services: Services, request: Request):
    """OpenAI's embeddings: one vector per input, from a model in embedding mode."""
    return services.embeddings.create(request.body, request.disconnected)


def rerank(services: Services, request: Request):
    """Rerank: documents scored against a query by a reranker model, best first.

    Jina's and Cohere's shape, as llama.cpp's server serves it."""
    return services.reranks.create(request.body, request.disconnected)


def audio_transcriptions(services: Services, request: Request):
    """OpenAI's transcription: a multipart audio file as text, json, verbose_json, srt or vtt.

    A chat with the clip and the model family's instruction; stream=true gives
    transcript.text.delta events."""
    from localrt.dialects import transcriptions

    return transcriptions.streamed(transcriptions.create(
        services.chats, services.registry.get, request.body, "transcribe",
        request.disconnected))


def audio_translations(services: Services, request: Request):
    """OpenAI's translation: a multipart audio file as English text, in any response_format."""
    from localrt.dialects import transcriptions

    return transcriptions.streamed(transcriptions.create(
        services.chats, services.registry.get, request.body, "translate",
        request.disconnected))


# --- Anthropic's Messages API (localrt.dialects.anthropic, on chat) ------------------------------


def anthropic_messages(services: Services, request: Request):
    """Anthropic's Messages API: a message, streamed as Anthropic's Server-Sent Events or not."""
    return _streamed(anthropic.messages(services.chats, request.body, request.disconnected))


def anthropic_count_tokens(services: Services, request: Request):
    """Anthropic's token count: the prompt's tokens in the model's own chat template."""
    return anthropic.count_tokens(services.chats, request.body, request.disconnected)


# --- llama-server's utility routes (localrt.inference.utility) ----------------------------


def tokenize(services: Services, request: Request):
    """llama-server's tokenize: a text's tokens in a running model's vocabulary."""
    return services.utility.tokenize(request.body)


def detokenize(services: Services, request: Request):
    """llama-server's detokenize: the text of tokens of a running model's vocabulary."""
    return services.utility.detokenize(request.body)


def apply_template(services: Services, request: Request):
    """llama-server's apply-template: the prompt a chat's messages become, not generated."""
    body = {k: v for k, v in request.body.items() if k in APPLY_TEMPLATE_FIELDS}
    return services.utility.apply_template(openai.read_chat({"model": "", **body}))


# What /apply-template reads of a chat body; the rest of one is accepted and ignored.
APPLY_TEMPLATE_FIELDS = ("model", "messages", "tools", "tool_choice", "parallel_tool_calls")


def props(services: Services, request: Request):
    """llama-server's props: a running model's context, slots, chat template and build."""
    return services.utility.props(request.query.get("model"))


def slots(services: Services, request: Request):
    """llama-server's slots: what each slot of a running model holds."""
    return services.utility.slots(request.query.get("model"),
                                  request.query.get("fail_on_no_slot") in ("1", "true"))


def lora_adapters(services: Services, request: Request):
    """llama-server's lora-adapters: a running model's LoRA adapters and their scales."""
    return services.utility.lora_adapters(request.query.get("model"))


def set_lora_adapters(services: Services, request: Request):
    """llama-server's lora-adapters: the scales of a running model's requests that give none."""
    return services.utility.set_lora_adapters(request.query.get("model"), request.body)


# --- engines -------------------------------------------------------------------------


def list_engines(services: Services, request: Request):
    """Every engine with its status, active variant and version."""
    return {"data": services.engines.list(), "object": "list", "result": "OK"}


def get_engine(services: Services, request: Request):
    """The installed variants of one engine."""
    return services.engines.variants(request.params["engine"])


def install_engine(services: Services, request: Request):
    """Install an engine variant; progress comes as Download* events of type Engine.

    A variant installed already is checked instead of fetched, with the same events."""
    body = request.body
    return services.installs.install(request.params["engine"], body.get("version"),
                                     body.get("variant"))


def uninstall_engine(services: Services, request: Request):
    """Uninstall an engine variant; refused while the engine runs a model."""
    body, name = request.body, request.params["engine"]
    with services.scheduler.engine_unused(name):
        return services.installs.uninstall(name, body.get("version"), body.get("variant"))


def install_engine_wheel(services: Services, request: Request):
    """Install a custom engine from a wheel path or URL."""
    return services.installs.install_wheel(request.body["wheel"])


def set_default_engine(services: Services, request: Request):
    """Choose which installed variant models of an engine load."""
    body = request.body
    return services.installs.set_default(request.params["engine"], body["variant"],
                                         body["version"])


def get_default_engine(services: Services, request: Request):
    """The installed variant models of an engine load: {engine, variant, version}."""
    return services.engines.default(request.params["engine"])


def engine_releases(services: Services, request: Request):
    """The versions of an engine the package index has, newest first (cortex's shape)."""
    return services.installs.releases(request.params["engine"])


def engine_release(services: Services, request: Request):
    """The variants of one version ("latest": the newest) the package index has."""
    return services.installs.release(request.params["engine"], request.params["version"])


def events(services: Services, request: Request):
    """Server-Sent Events: DownloadStarted, DownloadUpdated, DownloadSuccess, ...

    cortex sends the same events on a WebSocket at /events; here they are `data:`
    lines of an SSE stream. No /events alias: a WebSocket client could not read it."""
    stream = services.events.listen(request.disconnected)  # a 503 past max_listeners
    return Reply(stream, content_type="text/event-stream", headers=list(STREAM_HEADERS))


# --- OpenAI's Responses API (localrt.dialects.responses) -----------------------------------------


def create_response(services: Services, request: Request):
    """OpenAI's Responses API: a response with its output items, streamed or not.

    A stream is typed Server-Sent Events."""
    return _streamed(responses.create(services.chats, services.responses, request.body,
                                      request.disconnected))


def get_response(services: Services, request: Request):
    """A response stored with store: true since the server started."""
    return responses.get(services.responses, request.params["response_id"])


def delete_response(services: Services, request: Request):
    """Forget a stored response."""
    return responses.delete(services.responses, request.params["response_id"])


# --- Ollama's API, under /api/ (localrt.dialects.ollama translates) -------------------------


def ollama_version(services: Services, request: Request):
    """Ollama's version: the Ollama release whose API localrt follows."""
    return ollama.version()


def ollama_tags(services: Services, request: Request):
    """Ollama's list of the downloaded models."""
    return ollama_models.tags(services.ollama_names)


def ollama_ps(services: Services, request: Request):
    """Ollama's list of the running models."""
    return ollama_models.ps(services.requests, services.ollama_names)


def ollama_show(services: Services, request: Request):
    """Ollama's model information: Modelfile, parameters, template, details, GGUF metadata."""
    return ollama_models.show(services.ollama_names, request.body)


def ollama_chat(services: Services, request: Request):
    """Ollama's chat, streamed as newline-delimited JSON or not."""
    return _ollama_reply(ollama.chat(services.chats, services.requests, services.ollama_names,
                                     request.body, request.disconnected))


def ollama_generate(services: Services, request: Request):
    """Ollama's completion of a prompt, streamed as newline-delimited JSON or not."""
    return _ollama_reply(ollama.generate(services.chats, services.completions,
                                         services.requests, services.ollama_names,
                                         request.body, request.disconnected))


def ollama_embed(services: Services, request: Request):
    """Ollama's embeddings: one vector per input."""
    return ollama.embed(services.embeddings, services.requests, services.ollama_names,
                        request.body, request.disconnected)


def ollama_pull(services: Services, request: Request):
    """Ollama's pull: a download from the model hub, its progress streamed or not."""
    return _ollama_reply(ollama_models.pull(services.pulls, services.downloads,
                                            services.events, services.admissions["pull"],
                                            request.body, request.disconnected))


def ollama_delete(services: Services, request: Request):
    """Ollama's delete: a model's files and definition (stopped first if it runs)."""
    return ollama_models.delete(services.requests, services.ollama_names, request.body)


def _ollama_reply(result):
    """A dict as it is; newline-delimited JSON (ollama.Lines) as a streamed reply."""
    return _streamed(result) if isinstance(result, ollama_models.Lines) else result


def _streamed(result):
    """A handler's result: a dict as it is, or a stream (an iterable with its
    content_type and close()) as a reply that proxies must not buffer."""
    if isinstance(result, dict):
        return result
    return Reply(result, content_type=result.content_type, headers=list(STREAM_HEADERS))


# The body a route that takes images may have: base64 makes 20 MiB (the most one image
# may be, localrt.inference.media) 27 MiB, and a few smaller ones fit beside it.
IMAGE_BODY = 64 * 1024 * 1024
# An audio route's multipart body: one clip (25 MiB) and its text fields.
AUDIO_BODY = 26 * 1024 * 1024


def _audio_file(name: str, size: int):
    """The 413 of an audio form's file past 25 MiB (localrt.multipart.Limits.file)."""
    from localrt.dialects import transcriptions

    return transcriptions.file_too_large(name, size)


AUDIO_FORM = multipart.Limits(file=_audio_file)

# Fixed paths come before `{model_id:path}` ones: model ids hold "/" and ":".
ROUTES = (
    Route("GET", "/", web_page),
    Route("GET", "/web/{name}", web_file),
    Route("GET", "/healthz", healthz, reply="health"),
    Route("GET", "/metrics", metrics),
    Route("GET", "/openapi.json", openapi_document, reply="openapi"),
    Route("GET", "/v1/configs", get_configs, reply="config"),
    Route("PATCH", "/v1/configs", patch_configs, "config-update.json", "config-updated"),
    Route("DELETE", "/v1/system", stop_server, reply="message"),
    Route("GET", "/v1/events", events),
    Route("GET", "/v1/hardware", hardware, reply="hardware"),
    Route("GET", "/v1/engines", list_engines, reply="engine-list"),
    Route("POST", "/v1/engines/install", install_engine_wheel, "engine-wheel.json",
          "engine-install"),
    Route("GET", "/v1/engines/{engine}", get_engine, reply="engine-variants"),
    Route("GET", "/engines/{engine}", get_engine, reply="engine-variants"),  # also without /v1
    Route("POST", "/v1/engines/{engine}/install", install_engine, "engine-install.json",
          "engine-install"),
    Route("DELETE", "/v1/engines/{engine}/install", uninstall_engine, "engine-install.json",
          "message"),
    Route("GET", "/v1/engines/{engine}/default", get_default_engine, reply="engine-default"),
    Route("POST", "/v1/engines/{engine}/default", set_default_engine, "engine-default.json",
          "message"),
    Route("GET", "/v1/engines/{engine}/releases", engine_releases, reply="engine-releases"),
    Route("GET", "/v1/engines/{engine}/releases/{version}", engine_release,
          reply="engine-release"),
    Route("GET", "/v1/models", list_models, reply="model-list"),
    Route("GET", "/v1/models/status", models_status, reply="models-status"),
    Route("POST", "/v1/models/start", start_model, "model-start.json", "model-started"),
    Route("POST", "/v1/models/stop", stop_model, "model-stop.json", "model-stopped"),
    Route("GET", "/v1/models/pull", list_pulls, reply="task-list"),
    Route("POST", "/v1/models/pull", pull_model_body, "model-pull.json", "pull"),
    Route("DELETE", "/v1/models/pull", cancel_pull, "task-cancel.json", "task-stopping"),
    Route("POST", "/v1/models/variants", model_variants, "model-variants.json",
          "model-variants"),
    Route("POST", "/v1/models/import", import_model, "model-import.json", "model-changed"),
    Route("POST", "/v1/models/remote", add_remote_model, "model-remote.json", "model-changed"),
    Route("POST", "/v1/models/{model_id:path}/pull", pull_model, reply="pull"),
    Route("POST", "/v1/models/{model_id:path}/start", start_model, "model-start.json",
          "model-started"),
    Route("POST", "/v1/models/{model_id:path}/stop", stop_model, "model-stop.json",
          "model-stopped"),
    # also without /v1, as the engine route above
    Route("POST", "/models/{model_id:path}/stop", stop_model, "model-stop.json",
          "model-stopped"),
    Route("GET", "/v1/models/{model_id:path}", get_model, reply="model"),
    Route("DELETE", "/v1/models/{model_id:path}", delete_model, reply="model-deleted"),
    Route("PATCH", "/v1/models/{model_id:path}", update_model, "model-update.json",
          "model-changed"),
    Route("POST", "/v1/chat/completions", chat_completions, "chat-completion.json",
          "chat-completion", max_body=IMAGE_BODY),
    Route("POST", "/v1/completions", completions, "completion.json", "text-completion"),
    Route("POST", "/v1/embeddings", embeddings, "embedding.json", "embedding-list"),
    Route("POST", "/v1/audio/transcriptions", audio_transcriptions,
          "audio-transcription.json", "transcription", max_body=AUDIO_BODY, form=AUDIO_FORM),
    Route("POST", "/v1/audio/translations", audio_translations,
          "audio-transcription.json", "transcription", max_body=AUDIO_BODY, form=AUDIO_FORM),
    # llama.cpp's server's names for reranking (localrt.inference.rerank)
    Route("POST", "/v1/rerank", rerank, "rerank.json", "rerank"),
    Route("POST", "/rerank", rerank, "rerank.json", "rerank"),
    Route("POST", "/v1/reranking", rerank, "rerank.json", "rerank"),
    # OpenAI's Responses API (localrt.dialects.responses)
    Route("POST", "/v1/responses", create_response, "response-create.json", "response",
          max_body=IMAGE_BODY),
    Route("GET", "/v1/responses/{response_id}", get_response, reply="response"),
    Route("DELETE", "/v1/responses/{response_id}", delete_response, reply="response-deleted"),
    # Anthropic's Messages API (localrt.dialects.anthropic)
    Route("POST", "/v1/messages", anthropic_messages, "anthropic-messages.json",
          "anthropic-message", max_body=IMAGE_BODY),
    Route("POST", "/v1/messages/count_tokens", anthropic_count_tokens,
          "anthropic-count-tokens.json", "anthropic-token-count", max_body=IMAGE_BODY),
    # llama-server's utility routes (localrt.inference.utility), /v1/ or not
    Route("POST", "/tokenize", tokenize, "tokenize.json", "tokenize"),
    Route("POST", "/v1/tokenize", tokenize, "tokenize.json", "tokenize"),
    Route("POST", "/detokenize", detokenize, "detokenize.json", "detokenize"),
    Route("POST", "/v1/detokenize", detokenize, "detokenize.json", "detokenize"),
    Route("POST", "/apply-template", apply_template, "apply-template.json", "apply-template",
          max_body=IMAGE_BODY),
    Route("GET", "/props", props, reply="props", query=("model",)),
    Route("GET", "/slots", slots, reply="slots", query=("model", "fail_on_no_slot")),
    Route("GET", "/lora-adapters", lora_adapters, reply="lora-adapters", query=("model",)),
    Route("POST", "/lora-adapters", set_lora_adapters, "lora-adapters.json",
          "lora-adapters-set", query=("model",)),
    # Ollama's API (localrt.dialects.ollama), under /api/: its errors take Ollama's shape (DIALECTS)
    Route("GET", "/api/version", ollama_version, reply="ollama-version"),
    Route("GET", "/api/tags", ollama_tags, reply="ollama-tags"),
    Route("GET", "/api/ps", ollama_ps, reply="ollama-ps"),
    Route("POST", "/api/show", ollama_show, "ollama-model.json", "ollama-show"),
    Route("POST", "/api/chat", ollama_chat, "ollama-chat.json", "ollama-chat",
          max_body=IMAGE_BODY),
    Route("POST", "/api/generate", ollama_generate, "ollama-generate.json", "ollama-generate",
          max_body=IMAGE_BODY),
    Route("POST", "/api/embed", ollama_embed, "ollama-embed.json", "ollama-embed"),
    Route("POST", "/api/pull", ollama_pull, "ollama-pull.json", "ollama-status"),
    Route("DELETE", "/api/delete", ollama_delete, "ollama-model.json", "ollama-status"),
)

# Route families that speak another API's error shape (see routing.Dialect).
DIALECTS: tuple[Dialect, ...] = (
    Dialect("/v1/messages", anthropic.error_body, "anthropic-error"),
    Dialect("/api/", ollama.error_body, "ollama-error"),
)
