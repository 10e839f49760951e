"""The joining sites of a params file (`join.sites`), without torch: `lensemble join` checks the site's name
before it imports the model code (orchestration/joining.py), so a mistyped name is refused in well under a second."""
from __future__ import annotations

from lensemble.config import JoinSiteParams, Params
from lensemble.errors import ConfigError


def join_site(params: Params, name: str) -> JoinSiteParams:
    """The `join.sites` entry named `name`; ConfigError listing the joinable sites."""
    for j in params.join.sites:
        if j.name == name:
            return j
    known = [j.name for j in params.join.sites]
    raise ConfigError(f"unknown joining site {name!r}; join.sites in params: {known} (a joining site is declared there, "
                      "with its embodiment and episodes)")
