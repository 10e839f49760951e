"""Where each stage reads and writes, relative to the project root (DVC declares the same paths)."""
from __future__ import annotations

from pathlib import Path


class Layout:
    """Paths of one project checkout."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root).resolve()
        self.data = self.root / "data"
        self.reports = self.root / "reports"
        self.models = self.root / "models"
        self.exchange = self.root / "exchange"

    def site_dir(self, site: str) -> Path:
        return self.data / "sites" / site

    def site_episodes(self, site: str) -> Path:
        return self.site_dir(site) / "episodes.parquet"

    def join_episodes(self, site: str) -> Path:
        """A site joining after the federation (`lensemble join`): its episodes, at the site, outside every DVC output."""
        return self.data / "join" / site / "episodes.parquet"

    def site_manifest(self, site: str) -> Path:
        return self.site_dir(site) / "manifest.json"

    def site_audit(self, site: str) -> Path:
        """The site's residency audit log: site-local, outside every DVC output (append-only)."""
        return self.root / "audit" / f"{site}.jsonl"

    def probe(self, embodiment: str) -> Path:
        return self.data / "probe" / f"{embodiment}.parquet"

    def site_state(self, site: str) -> Path:
        return self.models / "sites" / f"{site}.pt"

    def metrics(self) -> Path:
        return self.reports / "metrics.jsonl"

    def manifest(self, stage: str) -> Path:
        return self.reports / "manifests" / f"{stage}.json"
