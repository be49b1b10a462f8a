"""Sizing a deployment before it is made: `deltamesh profile` measures what one worker of a model and parallelism
costs on this machine (profiler.py, written as one JSON profile: profile.py), and `deltamesh plan` turns profiles,
a traffic description and SLAs into the best colocated and xPyD layouts (search.py), each judged by a
discrete-event simulation of the router, the workers' queues and their engine steps (simulator.py). How to use
them: docs/planning.md."""
