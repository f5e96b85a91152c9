"""What the package index has of the built-in engines: their wheels, and cortex's releases.

cortex lists an engine's GitHub releases; localrt's engines come from a package index
(localrt.engines.wheels), so a release here is a version the index has of the engine's
distributions (all its variants'), and its variants are those of this machine with a
wheel of that version for this Python. `Releases` answers
`GET /v1/engines/{engine}/releases` and `.../releases/{version}`, and says what the
index has when an install names a version or variant it lacks. Installing is
localrt.engines.installs'.
"""

from __future__ import annotations

from typing import Callable, Mapping

from localrt.engines import wheels
from localrt.engines.catalog import EngineSpec, Variant, display_version
from localrt.errors import BadRequest
from localrt.engines.hardware import Hardware, runnable

LATEST = "latest"  # cortex's version for the newest


class Releases:
    """The index's view of the engines. It keeps nothing: each call asks the index."""

    def __init__(self, hardware: Hardware, config: Callable[[], Mapping],
                 index_url: Callable[[], str]):
        self._hardware = hardware
        self._config = config        # called per request, so Config changes apply at once
        self._index_url = index_url  # engineIndexUrl, read per request

    def files(self, distribution: str) -> list[wheels.Dist]:
        """The index's wheels of a distribution; none when it has no such project."""
        try:
            return wheels.project_files(self._config(), self._index_url(), distribution)
        except wheels.NoSuchProject:
            return []

    def releases(self, spec: EngineSpec) -> list[dict]:
        """cortex's releases of an engine: each version the index has, newest first.

        `url` is the project's page in the index; `published_at` the earliest upload
        time of the version's wheels (PEP 700), None where the index gives none.
        """
        variants = spec.variants(self._hardware)
        files = self._files_of(variants)
        page = wheels.project_url(self._index_url(), variants[0].distribution)
        out = []
        for version in _newest_first(d for found in files.values() for d in found):
            times = sorted(d.upload_time for found in files.values() for d in found
                           if d.upload_time and d.version.public == version)
            out.append({"name": display_version(version), "version": version, "url": page,
                        "draft": False, "prerelease": wheels.Version(version).is_prerelease,
                        "published_at": times[0] if times else None,
                        "variants": [v.name for v in variants if wheels.choose(
                            files[v.distribution], f"=={version}", v.local)]})
        return out

    def release(self, spec: EngineSpec, version: str) -> list[dict]:
        """cortex's variants of one release that this Python runs; none for a version the
        index does not have, as cortex answers. "latest" gives each variant's newest
        final version: the wheel an install without a version takes."""
        wanted = wanted_version(version)
        variants = spec.variants(self._hardware)
        files = self._files_of(variants)
        out = []
        for v in variants:
            dist = wheels.choose(files[v.distribution], f"=={wanted}" if wanted else "",
                                 v.local)
            if dist is not None:
                out.append({"name": v.name, "version": display_version(dist.version.public),
                            "file": dist.filename, "size": dist.size,
                            "created_at": dist.upload_time,
                            "compatible": runnable(v, self._hardware) is None})
        return out

    def _files_of(self, variants: list[Variant]) -> dict[str, list[wheels.Dist]]:
        """The index's wheels of each distribution the variants come from, asked once."""
        files: dict[str, list[wheels.Dist]] = {}
        for v in variants:
            if v.distribution not in files:
                files[v.distribution] = self.files(v.distribution)
        return files

    def no_wheel(self, chosen: Variant, version: str | None, files: list[wheels.Dist],
                 builtin: dict | None) -> BadRequest:
        """The 400 for a version, or a variant, the index has no wheel of for this Python:
        it names the field and lists the versions there are (and the shipped build)."""
        have = [display_version(v) for v in _newest_first(files)
                if wheels.choose(files, f"=={v}", chosen.local)]
        if builtin:
            have.append(f"{display_version(builtin['version'])} (the build that ships "
                        f"with localrt, variant {builtin['variant']})")
        wanted = f"{chosen.distribution} {version}" if version else chosen.distribution
        return BadRequest(f"The package index {self._index_url()} has no {wanted} wheel "
                          f"for variant {chosen.name} that this Python runs "
                          f"({wheels.supported_tags()[0]}); the versions there are for "
                          f"{chosen.name}: {', '.join(have) or 'none'}",
                          param="version" if version else "variant")


def wanted_version(version: str | None) -> str | None:
    """A version a request names, without its "v" and normalized (PEP 440); None for
    none or "latest". A 400 naming `version` if it is no version."""
    if version is None or version == LATEST:
        return None
    try:
        return str(wheels.Version(bare_version(version)))
    except wheels.InvalidVersion:
        raise BadRequest(f"Invalid field 'version': {version!r} is not a version "
                         f"(such as v0.3.36, or latest)", param="version") from None


def bare_version(version: str) -> str:
    """A version as engines.json records it: v0.3.36 is 0.3.36."""
    return version[1:] if version.startswith("v") else version


def _newest_first(dists) -> list[str]:
    return sorted({d.version.public for d in dists}, key=wheels.Version, reverse=True)
