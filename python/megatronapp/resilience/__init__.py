"""Keeping a job alive and diagnosable: fault injection for tests and
drills (:mod:`.faults`: slow ranks, link delays, kills) and the watchdog
(:mod:`.watchdog`: dead-rank heartbeat, stack dumps of a hung rank)."""
