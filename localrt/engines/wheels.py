"""Engine wheels: find them in a package index, pick one this Python runs, unpack it.

The index speaks PEP 691 (JSON) or PEP 503 (HTML); both are asked for in one Accept
header and the reply's Content-Type says which came back. Requests go through
`opener.open_url`, so the proxy and TLS settings of Config apply. Version and
marker logic is `packaging`'s (PEP 440 and PEP 508 are easy to get subtly wrong).

Wheels are never pip-installed: `unpack` extracts one into an engine folder, which
the engine manager puts on sys.path when the engine's first model starts. The
RECORD each wheel carries stays there, so `recorded_files` can say later what an
installed distribution's files must be (the same for one pip installed).
"""

from __future__ import annotations

import base64
import csv
import email.parser
import html.parser
import json
import os
import re
import stat
import sys
import zipfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Iterable, Mapping
from urllib.parse import urldefrag, urljoin

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.tags import sys_tags
from packaging.utils import (InvalidSdistFilename, InvalidWheelFilename, canonicalize_name,
                             parse_sdist_filename, parse_wheel_filename)
from packaging.version import InvalidVersion, Version

from localrt.outbound import open_url
from localrt.errors import UpstreamError

JSON_TYPE = "application/vnd.pypi.simple.v1+json"
ACCEPT = f"{JSON_TYPE}, application/vnd.pypi.simple.v1+html;q=0.2, text/html;q=0.1"
MAX_PAGE = 32 * 1024 * 1024  # bytes of one project page; PyPI's largest are a few MB


class PackageIndexError(UpstreamError):
    """The package index could not be read, or does not have the project."""


class NoSuchProject(PackageIndexError):
    """The package index answered 404 for the project: it has no file of it."""


@dataclass(frozen=True)
class Dist:
    """One wheel listed by the index (or an sdist, with no tags: `project_sdists`)."""

    filename: str
    url: str
    sha256: str | None
    size: int | None
    version: Version
    tags: frozenset
    requires_python: str | None = None
    upload_time: str | None = None  # ISO 8601, where the index gives it (PEP 700)


def project_url(index_url: str, project: str) -> str:
    """The page of `project` in the index (PEP 503's normalized name)."""
    return urljoin(index_url.rstrip("/") + "/", canonicalize_name(project) + "/")


def project_files(config: Mapping, index_url: str, project: str) -> list[Dist]:
    """Every wheel the index lists for `project` (sdists and unparsable names skipped)."""
    dists = []
    for href, filename, sha256, size, requires_python, uploaded in _links(config, index_url,
                                                                          project):
        try:
            _, version, _, tags = parse_wheel_filename(filename)
        except (InvalidWheelFilename, InvalidVersion):
            continue  # an sdist, or a name that is not a wheel's
        dists.append(Dist(filename, href, sha256, size, version,
                          frozenset(str(t) for t in tags), requires_python, uploaded))
    return dists


def project_sdists(config: Mapping, index_url: str, project: str) -> list[Dist]:
    """Every source distribution (.tar.gz) the index lists for `project`, as Dists
    without tags (localrt.engines.builds compiles one into a wheel)."""
    dists = []
    for href, filename, sha256, size, requires_python, uploaded in _links(config, index_url,
                                                                          project):
        if not filename.endswith(".tar.gz"):
            continue
        try:
            _, version = parse_sdist_filename(filename)
        except (InvalidSdistFilename, InvalidVersion):
            continue
        dists.append(Dist(filename, href, sha256, size, version, frozenset(),
                          requires_python, uploaded))
    return dists


def choose_sdist(dists: Iterable[Dist], version: str | None) -> Dist | None:
    """The sdist of `version`, or the newest final one for None (this Python allowing)."""
    python = ".".join(map(str, sys.version_info[:3]))
    fit = [d for d in dists if (version is None and not d.version.is_prerelease
                                or version is not None and d.version == Version(version))
           and (not d.requires_python or _python_ok(d.requires_python, python))]
    return max(fit, key=lambda d: d.version, default=None)


def _links(config: Mapping, index_url: str, project: str) -> list[tuple]:
    """(url, filename, sha256, size, requires-python, upload-time) of each file the
    index lists for `project`, yanked ones left out."""
    url = project_url(index_url, project)
    try:
        with open_url(config, url, headers={"Accept": ACCEPT}, timeout=30.0) as resp:
            body = resp.read(MAX_PAGE + 1)
            kind = resp.headers.get_content_type()
            final_url = resp.url
    except OSError as exc:  # HTTPError included
        code = getattr(exc, "code", None)
        if code == 404:
            raise NoSuchProject(f"The package index {index_url} has no project "
                                f"{project!r}") from None
        raise PackageIndexError(f"Cannot read {url}: {getattr(exc, 'reason', exc)}") from None
    if len(body) > MAX_PAGE:
        raise PackageIndexError(f"{url} is larger than {MAX_PAGE} bytes")
    try:
        if kind == JSON_TYPE:
            links = [(f.get("url"), f.get("filename"), (f.get("hashes") or {}).get("sha256"),
                      f.get("size"), f.get("requires-python"), f.get("upload-time"))
                     for f in json.loads(body)["files"] if not f.get("yanked")]
        else:
            links = _HTMLLinks.parse(body.decode("utf-8", "replace"))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise PackageIndexError(f"{url} is not a package index page ({exc})") from None
    out = []
    for href, filename, sha256, size, requires_python, uploaded in links:
        if not isinstance(href, str) or not isinstance(filename, str):
            continue
        href, fragment = urldefrag(urljoin(final_url, href))
        if sha256 is None and fragment.startswith("sha256="):
            sha256 = fragment[len("sha256="):]
        out.append((href, filename, sha256 if isinstance(sha256, str) else None,
                    size if isinstance(size, int) else None, requires_python,
                    uploaded if isinstance(uploaded, str) else None))
    return out


class _HTMLLinks(html.parser.HTMLParser):
    """The <a> elements of a PEP 503 page: (href, text, None, None, requires-python, None)."""

    def __init__(self):
        super().__init__()
        self.links: list = []
        self._open: dict | None = None

    @classmethod
    def parse(cls, text: str) -> list:
        parser = cls()
        parser.feed(text)
        parser.close()
        return parser.links

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            attrs = dict(attrs)
            if "data-yanked" not in attrs:
                self._open = {"href": attrs.get("href"), "text": "",
                              "requires": attrs.get("data-requires-python")}

    def handle_data(self, data):
        if self._open is not None:
            self._open["text"] += data

    def handle_endtag(self, tag):
        if tag == "a" and self._open is not None:
            link, self._open = self._open, None
            self.links.append((link["href"], link["text"].strip(), None, None,
                               link["requires"], None))


def wheel_tags(filename: str) -> frozenset:
    """The tags of a wheel file name; ValueError if it is not one."""
    try:
        return frozenset(str(t) for t in parse_wheel_filename(filename)[3])
    except (InvalidWheelFilename, InvalidVersion) as exc:
        raise ValueError(str(exc)) from None


def content_length(config: Mapping, url: str) -> int:
    """The size of the file at `url`, for indexes that do not list sizes."""
    try:
        with open_url(config, url, headers={"Range": "bytes=0-0"}, timeout=30.0) as resp:
            total = resp.headers.get("Content-Range", "").rpartition("/")[2]
            length = total if resp.status == 206 else resp.headers.get("Content-Length")
            return int(length)
    except (TypeError, ValueError):
        raise PackageIndexError(f"{url} does not say how large it is") from None
    except OSError as exc:
        raise PackageIndexError(f"Cannot read {url}: {getattr(exc, 'reason', exc)}") \
            from None


def supported_tags() -> list[str]:
    """This interpreter's wheel tags, most preferred first."""
    return [str(t) for t in sys_tags()]


def choose(dists: Iterable[Dist], specifier: str = "", local: str | None = None,
           tags: list[str] | None = None) -> Dist | None:
    """The newest wheel matching `specifier` and the local label that this Python runs."""
    tags = supported_tags() if tags is None else tags
    rank = {tag: i for i, tag in enumerate(tags)}
    spec = SpecifierSet(specifier)
    python = ".".join(map(str, sys.version_info[:3]))
    best = None
    for dist in dists:
        if dist.version.local != local:
            continue
        public = Version(dist.version.public)
        # No specifier: no pre-releases (packaging 26 lets them in with None).
        if not spec.contains(public, prereleases=bool(specifier)):
            continue
        if dist.requires_python and not _python_ok(dist.requires_python, python):
            continue
        ranks = [rank[t] for t in dist.tags if t in rank]
        if not ranks:
            continue
        key = (public, -min(ranks))
        if best is None or key > best[0]:
            best = (key, dist)
    return None if best is None else best[1]


def _python_ok(requires_python: str, python: str) -> bool:
    try:
        return SpecifierSet(requires_python).contains(python, prereleases=True)
    except ValueError:
        return True  # an index's malformed metadata is not a reason to refuse


def read_metadata(wheel: Path):
    """The METADATA of a wheel file, as an email.message.Message."""
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist()
                 if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)]
        if len(names) != 1:
            raise ValueError(f"{wheel.name} is not a wheel (no single .dist-info/METADATA)")
        return email.parser.BytesParser().parsebytes(zf.read(names[0]), headersonly=True)


def entry_points(wheel: Path, group: str) -> dict[str, str]:
    """The entry points of `group` a wheel declares: name -> "module:object"."""
    import configparser

    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist()
                 if re.fullmatch(r"[^/]+\.dist-info/entry_points\.txt", n)]
        if not names:
            return {}
        parser = configparser.ConfigParser(delimiters=("=",), interpolation=None)
        parser.optionxform = str
        parser.read_string(zf.read(names[0]).decode("utf-8"))
    return dict(parser[group]) if parser.has_section(group) else {}


def missing_requirements(meta, available: Mapping[str, str]) -> list[Requirement]:
    """Requirements of a wheel (its METADATA) that neither this Python nor `available` meet.

    `available` maps canonical names to versions already planned for the engine
    folder. Extras are not installed, so requirements only for an extra are skipped.
    """
    missing = []
    for line in meta.get_all("Requires-Dist") or []:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            raise ValueError(f"invalid requirement {line!r} in the wheel's METADATA") from None
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(req.name)
        version = available.get(name) or _installed_version(req.name)
        if version is not None and req.specifier.contains(version, prereleases=True):
            continue
        missing.append(req)
    return missing


def _installed_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def unpack(wheel: Path, target: Path) -> list[str]:
    """Extract a wheel's files into `target` (its site-packages); return the paths.

    Each lands where `site_name` says, as pip would put it; paths that would leave
    `target` are refused. Unix modes are kept, so shared
    libraries stay executable.
    """
    written = []
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            name = site_name(info.filename)
            if info.is_dir() or not name:
                continue
            dest = (target / name).resolve()
            if not dest.is_relative_to(target.resolve()) or "\\" in name:
                raise ValueError(f"{wheel.name} holds an unsafe path: {info.filename!r}")
            dest.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as src, open(dest, "wb") as out:
                while chunk := src.read(1024 * 1024):
                    out.write(chunk)
            mode = (info.external_attr >> 16) & 0o777
            if mode:
                dest.chmod(mode | stat.S_IRUSR | stat.S_IWUSR)
            written.append(name)
    return written


def unpacked_size(wheel: Path, block: int = 4096) -> int:
    """The disk space `unpack` takes for a wheel: each file it writes, in whole blocks."""
    with zipfile.ZipFile(wheel) as zf:
        return sum(-(-info.file_size // block) * block for info in zf.infolist()
                   if not info.is_dir() and site_name(info.filename))


def site_name(name: str) -> str | None:
    """Where a wheel's file lands in its site-packages folder (None: it is not unpacked).

    `.data/purelib` and `.data/platlib` land at the top, as pip puts them; the other
    `.data` parts (scripts, headers, data) are not needed by an engine.
    """
    data_dir = re.match(r"[^/]+\.data/(purelib|platlib|[^/]+)/", name)
    if data_dir is None:
        return name
    return name[data_dir.end():] if data_dir.group(1) in ("purelib", "platlib") else None


def recorded_files(dist_info: Path) -> list[tuple[Path, str, int | None]]:
    """(path, sha256 hex, size or None) of each file a distribution's RECORD hashes.

    `dist_info` is its `.dist-info` folder in a site-packages folder: an engine folder
    that `unpack` filled, or localrt's own environment that pip filled. Files RECORD
    lists outside that folder (pip's scripts, `../../bin/...`) and unhashed ones (the
    RECORD itself, compiled .pyc files) are left out. Raises OSError if there is no
    RECORD, ValueError if it cannot be read.
    """
    root = os.path.normpath(dist_info.parent)
    text = (dist_info / "RECORD").read_text("utf-8")
    out = []
    for row in csv.reader(text.splitlines()):
        if len(row) != 3 or not row[1].startswith("sha256="):
            continue
        name = site_name(row[0])
        path = os.path.normpath(os.path.join(root, name)) if name else None
        if path is None or not path.startswith(root + os.sep):
            continue
        encoded = row[1][len("sha256="):]
        try:
            digest = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).hex()
            size = int(row[2]) if row[2] else None
        except ValueError:
            raise ValueError(f"{dist_info.name}/RECORD: unreadable row {row!r}") from None
        out.append((Path(path), digest, size))
    return out
