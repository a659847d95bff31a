"""The headless state of an interactive front end: the workspace of a loaded dump and what is
derived from it (`workspace`), the memory budgets (`budget`), what the server may do
(`serving`) and the options it is launched with (`launch`).

Rule: imports the floors below it, never its sibling `iscore.present`; no streamlit.
"""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach(
    __name__,
    submod_attrs={
        "budget": ["WorkspaceCache"],
        "launch": ["APP_FLAGS", "APP_OPTIONS", "Options", "parse_options"],
        "serving": ["FOLLOW_INTERVAL_S", "LOOPBACK_HOSTS", "host_allowed"],
        "workspace": [
            "Selection",
            "worst_sequences_sql",
            "Workspace",
            "digest",
            "fingerprint",
            "open_path",
            "open_uploads",
        ],
    },
)
