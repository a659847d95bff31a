"""The only place a dump streams through settings into statistics: `analyze` (`analysis`),
the sequence table (`sequences`), `validate` (`validation`), a followed run (`follow`) and the
results store that keeps what a pass computed (`results_store`), in this process or on Ray.

Rule: imports every floor below it; nothing here is shown to people (`iscore.present`) or held
for a front end (`iscore.session`).
"""
