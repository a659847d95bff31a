"""Every decision, made once and carried as data: the health verdict (`health`) against
published reference values (`reference`), the recommendation of a setting (`recommendation`),
threshold tuning (`tuning`), export between frameworks (`conversion`) and a run's trend and
events (`trend`).

Rule: reads statistics and dumps from the floors below, never streams a dump through settings
(`iscore.passes` does).
"""
