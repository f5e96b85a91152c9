"""Models: what a model id means, and (to come) the registry of downloaded models.

Id shapes (spec 2.4):
  <name>                  built-in repo <org>/<name>, branch main
  <name>:<variant>        built-in repo <org>/<name>, branch <variant>
  <org>/<repo>            a hub repository; the GGUF file is chosen later
  <org>/<repo>:<file>     a hub repository and one file in it
  https://<hub>/<org>/<repo>/(blob|resolve)/<rev>/<file>
Ids are checked here before any I/O, so none can escape the models folder.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from localrt.errors import InvalidField

MAX_ID_BYTES = 255
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*\Z")  # hub org, repo and branch names


@dataclass(frozen=True)
class ModelRef:
    """Where a model id points on the hub."""

    repo: str              # "<org>/<repo>"
    revision: str          # a branch name
    file: str | None       # a file in the repo, or None when the repo decides (built-ins)
    builtin: bool

    @property
    def local_id(self) -> str:
        """The id the model is registered under once pulled."""
        org, name = self.repo.split("/")
        if self.builtin:
            return name if self.revision == "main" else f"{name}:{self.revision}"
        if self.file is None:
            return self.repo
        return f"{org}:{name}:{self.file}"


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


def parse_id(model_id: str, hub_url: str, org: str, param: str = "model") -> ModelRef:
    """Turn a model id of any shape into a ModelRef, or raise InvalidField."""
    check_id(model_id, param)
    if model_id.startswith(("http://", "https://")):
        return _parse_url(model_id, hub_url, param)
    head, sep, tail = model_id.partition(":")
    if "/" in head:
        org_name, repo_name = _split_repo(head, param)
        file = tail if sep else None
        if sep and not tail:
            raise InvalidField(f"Invalid field '{param}': empty file name after ':'",
                               param=param)
        return ModelRef(f"{org_name}/{repo_name}", "main", file, builtin=False)
    if not _NAME.match(head) or (sep and not _NAME.match(tail)):
        raise InvalidField(f"Invalid field '{param}': '{model_id}' is not a model id; use "
                           f"<name>, <name>:<variant>, <org>/<repo> or <org>/<repo>:<file>",
                           param=param)
    return ModelRef(f"{org}/{head}", tail if sep else "main", None, builtin=True)


def _split_repo(repo: str, param: str) -> tuple[str, str]:
    parts = repo.split("/")
    if len(parts) != 2 or not all(_NAME.match(p) for p in parts):
        raise InvalidField(f"Invalid field '{param}': '{repo}' is not a hub repository "
                           f"shaped <org>/<repo>", param=param)
    return parts[0], parts[1]


def _parse_url(url: str, hub_url: str, param: str) -> ModelRef:
    parts, hub = urlsplit(url), urlsplit(hub_url)
    if (parts.scheme, parts.netloc) != (hub.scheme, hub.netloc):
        raise InvalidField(f"Invalid field '{param}': {parts.scheme}://{parts.netloc} is not "
                           f"the configured model hub ({hub_url})", param=param)
    segments = [unquote(s) for s in parts.path.strip("/").split("/")]
    if len(segments) < 5 or segments[2] not in ("blob", "resolve"):
        raise InvalidField(f"Invalid field '{param}': expected a URL shaped "
                           f"{hub_url}/<org>/<repo>/resolve/<revision>/<file>", param=param)
    org_name, repo_name = _split_repo("/".join(segments[:2]), param)
    revision, file = segments[3], "/".join(segments[4:])
    check_id(file, param)
    return ModelRef(f"{org_name}/{repo_name}", revision, file, builtin=False)
