"""The headless state of an interactive front end: the workspace of loaded dumps and what is
derived from them (`workspace`), the memory budgets (`budget`) and what the server may do
(`serving`).

Rule: imports the floors below it, never its sibling `iscore.present`; no streamlit.
"""
