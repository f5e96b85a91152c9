"""Model ids: what each shape means on the hub, checked before any I/O.

Id shapes, and what each pulls (man/localrt-api.7 says the same for users):
  <name>, <org>/<name>        a built-in, the repo <org>/<name> (org: modelHubOrg): the
                              branch its main's metadata.yml names as `default`, else
                              its one branch besides main; registered as <name>:<branch>
  <name>:<branch>             that branch of the built-in (404 naming the others)
  <org>/<repo>                a hub repository's GGUF: its only one, else its Q4_K_M
                              one, else a 400 listing them; a repo with no GGUF but
                              ONNX files is pulled whole. Registered as <org>:<repo>:<file>
  <org>/<repo>:<x>            x is a file of the repo, a quantization (Q8_0, any case),
                              or a branch
  <org>:<repo>:<x>            the same: the id a pull registers, so it can be pulled again
  https://<hub>/<org>/<repo>[/tree/<rev>]  the repo (a built-in's branch for modelHubOrg)
  https://<hub>/<org>/<repo>/(blob|resolve)/<rev>/<file>  that file (a built-in's branch)
A split GGUF (-00001-of-00003.gguf) is one model: every part is pulled, the first
loaded (localrt.models.pulls). Ids are checked here before any I/O, so none can escape
the models folder.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from urllib.parse import quote, unquote, urlsplit

from localrt.errors import InvalidField

MAX_ID_BYTES = 255
# Ids that the fixed routes under /v1/models/ shadow (localrt.api.ROUTES): a model
# registered under one could not be read, started or deleted. If you add such a
# route, add its last path segment here.
RESERVED_IDS = ("pull", "import", "start", "stop", "status", "variants", "remote")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*\Z")  # hub org, repo and branch names
# A split GGUF's part: (stem)-(part)-of-(total).gguf; localrt.models.pulls groups them.
SPLIT_GGUF = re.compile(r"(.*)-(\d{5})-of-(\d{5})\.gguf\Z", re.IGNORECASE)
# A quantization in a GGUF file name: Q4_K_M, q8_0, IQ4_XS, TQ1_0, F16, BF16, F32.
_QUANT = re.compile(r"(?<![A-Za-z0-9])(?:[IT]?Q[0-9]+(?:_[A-Za-z0-9]+)*|BF16|F16|F32|FP16|FP32)"
                    r"(?![A-Za-z0-9])", re.IGNORECASE)


@dataclass(frozen=True)
class ModelRef:
    """Where a model id points on the hub, before the hub is asked."""

    repo: str               # "<org>/<repo>"
    revision: str | None    # a branch; None: the repo decides (metadata.yml, or main)
    file: str | None        # an exact file path in the repo
    builtin: bool
    pick: str | None = None  # <x> of <org>/<repo>:<x>: a file, a quantization or a branch

    @property
    def known_id(self) -> str | None:
        """The id a pull of this ref registers, when it is known without the hub."""
        org, name = self.repo.split("/")
        if self.builtin:
            return f"{name}:{self.revision}" if self.revision else None
        if self.file is not None and not SPLIT_GGUF.match(self.file):
            return f"{org}:{name}:{self.file}"
        return None


def check_id(model_id: str, param: str = "model") -> str:
    """Reject ids that are empty, too long, or could escape the models folder."""
    if not isinstance(model_id, str) or not model_id.strip():
        raise InvalidField(f"Invalid field '{param}': the model id is empty", param=param)
    if len(model_id.encode("utf-8")) > MAX_ID_BYTES:
        raise InvalidField(f"Invalid field '{param}': the model id is longer than "
                           f"{MAX_ID_BYTES} bytes", param=param)
    if any(ord(c) < 32 or ord(c) == 127 for c in model_id):
        raise InvalidField(f"Invalid field '{param}': the model id holds a control character",
                           param=param)
    if "\\" in model_id:
        raise InvalidField(f"Invalid field '{param}': the model id holds a backslash",
                           param=param)
    if not model_id.startswith(("http://", "https://")):
        if model_id.startswith("/") or model_id.startswith("~"):
            raise InvalidField(f"Invalid field '{param}': the model id is an absolute path",
                               param=param)
        if any(part in (".", "..") for part in re.split(r"[/:]", model_id)):
            raise InvalidField(f"Invalid field '{param}': the model id holds a '.' or '..' "
                               f"segment", param=param)
    return model_id


def check_new_id(model_id: str, param: str = "model") -> str:
    """check_id, and refuse the ids the API's fixed routes shadow, for a model to register."""
    check_id(model_id, param)
    if model_id in RESERVED_IDS:
        raise InvalidField(f"Invalid field '{param}': {model_id!r} cannot be a model id, "
                           f"because /v1/models/{model_id} is another endpoint; choose "
                           f"another id", param=param)
    return model_id


def parse_id(model_id: str, hub_url: str, org: str, param: str = "model") -> ModelRef:
    """Turn a model id of any shape into a ModelRef, or raise InvalidField."""
    check_id(model_id, param)
    if model_id.startswith(("http://", "https://")):
        return _parse_url(model_id, hub_url, org, param)
    parts = model_id.split(":", 2)
    if len(parts) == 3 and "/" not in parts[0] + parts[1]:  # <org>:<repo>:<x>, as registered
        org_name, repo_name = _split_repo(f"{parts[0]}/{parts[1]}", param)
        return _repo_ref(org_name, repo_name, None, _pick(parts[2], param), org)
    head, sep, tail = model_id.partition(":")
    if sep and not tail:
        raise InvalidField(f"Invalid field '{param}': '{model_id}' is not a model id: nothing "
                           f"follows ':'", param=param)
    if "/" in head:
        org_name, repo_name = _split_repo(head, param)
        return _repo_ref(org_name, repo_name, None, _pick(tail, param) if sep else None, org)
    if not _NAME.match(head) or (sep and not _NAME.match(tail)):
        raise InvalidField(f"Invalid field '{param}': '{model_id}' is not a model id; use "
                           f"<name>, <name>:<branch>, <org>/<repo>, <org>/<repo>:<file> or "
                           f"<org>/<repo>:<quantization>", param=param)
    return ModelRef(f"{org}/{head}", tail if sep else None, None, builtin=True)


def _repo_ref(org_name: str, repo_name: str, revision: str | None, pick: str | None,
              builtin_org: str) -> ModelRef:
    """<org>/<repo>[:<pick>]; in the built-ins' org a pick that is no file is a branch."""
    if org_name.lower() == builtin_org.lower() and (pick is None or _NAME.match(pick)) \
            and not (pick or "").lower().endswith(".gguf"):
        return ModelRef(f"{builtin_org}/{repo_name}", pick or revision, None, builtin=True)
    return ModelRef(f"{org_name}/{repo_name}", revision, None, builtin=False, pick=pick)


def _pick(text: str, param: str) -> str:
    if not safe_relative(text):
        raise InvalidField(f"Invalid field '{param}': {text!r} is not a file, quantization or "
                           f"branch name", param=param)
    return text


def _split_repo(repo: str, param: str) -> tuple[str, str]:
    parts = repo.split("/")
    if len(parts) != 2 or not all(_NAME.match(p) for p in parts):
        raise InvalidField(f"Invalid field '{param}': '{repo}' is not a hub repository "
                           f"shaped <org>/<repo>", param=param)
    return parts[0], parts[1]


def _parse_url(url: str, hub_url: str, builtin_org: str, param: str) -> ModelRef:
    parts, hub = urlsplit(url), urlsplit(hub_url)
    if (parts.scheme, parts.netloc) != (hub.scheme, hub.netloc):
        raise InvalidField(f"Invalid field '{param}': {parts.scheme}://{parts.netloc} is not "
                           f"the configured model hub ({hub_url})", param=param)
    segments = [unquote(s) for s in parts.path.strip("/").split("/")]
    shaped = len(segments) == 2 or (len(segments) == 4 and segments[2] == "tree") or \
        (len(segments) >= 5 and segments[2] in ("blob", "resolve"))
    if not shaped:
        raise InvalidField(f"Invalid field '{param}': expected a URL shaped "
                           f"{hub_url}/<org>/<repo>, {hub_url}/<org>/<repo>/tree/<branch> or "
                           f"{hub_url}/<org>/<repo>/resolve/<revision>/<file>", param=param)
    org_name, repo_name = _split_repo("/".join(segments[:2]), param)
    revision = segments[3] if len(segments) > 3 else None
    if revision is not None and not safe_relative(revision):
        raise InvalidField(f"Invalid field '{param}': {revision!r} is not a revision",
                           param=param)
    is_builtin_org = org_name.lower() == builtin_org.lower()
    if len(segments) <= 4:  # the repo, or one branch of it
        return ModelRef(f"{org_name}/{repo_name}", revision, None, builtin=is_builtin_org)
    if is_builtin_org and revision != "main":  # a file of a built-in's branch: that branch
        return ModelRef(f"{org_name}/{repo_name}", revision, None, builtin=True)
    file = "/".join(segments[4:])
    check_id(file, param)
    return ModelRef(f"{org_name}/{repo_name}", revision, file, builtin=False)


def folder_name(model_id: str) -> str:
    """A folder name for an imported or remote model: the quoted id, or a digest if long."""
    name = quote(model_id, safe="")
    if len(name) <= 120:
        return name
    return "id-" + hashlib.sha256(model_id.encode("utf-8")).hexdigest()[:40]


def safe_relative(path: str) -> bool:
    """Whether a path from the hub stays inside the folder it is joined to."""
    parts = path.split("/")
    return bool(path) and len(path.encode("utf-8")) <= 1024 and "\\" not in path and \
        not path.startswith("/") and all(p not in ("", ".", "..") for p in parts) and \
        not any(ord(c) < 32 or ord(c) == 127 for c in path)


def quantization(path: str) -> str | None:
    """The quantization a GGUF file's name says (Q4_K_M, Q8_0, F16...), upper-cased."""
    stem = path.rsplit("/", 1)[-1]
    split = SPLIT_GGUF.match(stem)
    stem = split.group(1) if split else stem[:-5] if stem.lower().endswith(".gguf") else stem
    found = _QUANT.findall(stem)
    return found[-1].upper() if found else None
