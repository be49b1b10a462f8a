"""What the router and the engine agree on about a request, free of torch: the sampling parameters with their
defaults and checks (`sampling`), the refusal of a request the engine cannot serve and the checks that need only
the model's shape (`requests`), and the keys that name prompt blocks (`blocks`). The router process imports these
and never the engine's device code, so it starts without torch."""
