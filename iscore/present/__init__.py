"""Results into things people read: figures as plotly JSON specs (`figures`), the HTML report
(`report`) and TensorBoard scalars (`scalars`), computing nothing new.

Rule: imports the floors below it, never its sibling `iscore.session`; no streamlit, and plotly
only as its JSON format.
"""
