"""The API page's files: fetched from the npm registry with npm, held to the pinned integrity,
only the page's files put in the archive's stage, and an archive without them said so."""

import shutil
import tarfile

import pytest

from embedserve.archive import swagger_ui
from embedserve.archive.swagger_ui import INTEGRITY, PACKAGE, VERSION, AssetsError, integrity, stage_assets
from embedserve.handler.api.docs_page import ASSETS, ASSETS_FOLDER, assets_present, docs_answer


@pytest.fixture(scope="module")
def real_tarball():
    """The pinned tarball, as the build gets it: from build/swagger-ui/, else from the registry."""
    return swagger_ui.tarball()


def test_the_pinned_tarball_matches_its_integrity(real_tarball):
    assert integrity(real_tarball) == INTEGRITY
    assert real_tarball.name == f"{PACKAGE}-{VERSION}.tgz"


def test_the_stage_gets_only_the_page_files_and_the_licence(real_tarball, tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    shutil.copy(real_tarball, cache)
    line = stage_assets(tmp_path / "stage", cache)
    folder = tmp_path / "stage" / ASSETS_FOLDER
    assert sorted(p.name for p in folder.iterdir()) == sorted(ASSETS)
    assert "Apache License" in (folder / "LICENSE").read_text()
    size = sum(p.stat().st_size for p in folder.iterdir())
    assert size < 2_500_000 and line.startswith(f"API page (<version>/docs): {PACKAGE} {VERSION}")
    assert assets_present(folder)
    status, body, _ = docs_answer("swagger-ui-bundle.js", "/predictions/m/1.0/openapi.json", folder)
    assert status == 200 and b"SwaggerUIBundle" in body


def test_a_cached_tarball_that_does_not_match_is_fetched_again_with_npm(real_tarball, tmp_path):
    (tmp_path / real_tarball.name).write_bytes(b"not the tarball")
    assert integrity(swagger_ui.tarball(tmp_path)) == INTEGRITY
    assert [p.name for p in tmp_path.iterdir()] == [real_tarball.name]  # no fetch folder left


def test_a_fetched_tarball_that_does_not_match_is_refused(tmp_path, monkeypatch):
    def forged(folder):  # as a registry or mirror serving other bytes would
        path = folder / f"{PACKAGE}-{VERSION}.tgz"
        with tarfile.open(path, "w:gz"):
            pass
        return path

    monkeypatch.setattr(swagger_ui, "_npm_pack", forged)
    with pytest.raises(AssetsError, match="not the pinned"):
        swagger_ui.tarball(tmp_path)
    assert not list(tmp_path.glob("*.tgz"))


def test_without_npm_the_archive_goes_without_the_page_and_the_build_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    line = stage_assets(tmp_path / "stage", tmp_path / "cache")
    assert line.startswith("warning: this archive has NO API page") and "npm is not installed" in line
    assert not (tmp_path / "stage" / ASSETS_FOLDER).exists()


def test_with_the_registry_unreachable_the_build_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("npm_config_registry", "http://127.0.0.1:9/")  # nothing listens on the discard port
    monkeypatch.setenv("npm_config_cache", str(tmp_path / "npm-cache"))  # nothing cached to fall back on
    line = stage_assets(tmp_path / "stage", tmp_path / "cache")
    assert line.startswith("warning: this archive has NO API page") and "ECONNREFUSED" in line
    assert "python -m embedserve.archive.swagger_ui" in line
    assert not (tmp_path / "stage" / ASSETS_FOLDER).exists() and not list((tmp_path / "cache").iterdir())
