"""Placement: decides where each variable lives (a PS table or mirrored) and moves it.

plan.py is the planner, pure Python: the policy, the plan and row sharding. creation.py
describes a variable as it is created; mirroring.py moves a PS table to mirrored.
"""
