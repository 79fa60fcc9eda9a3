"""The schedule compiler: pure Python, no torch. An instruction IR (ir), 1F1B
streams ordered per node (order, lower), redundant forwards placed in the bubbles
and lazy backwards (redundancy), the recovery streams a death leaves (recovery),
evaluation streams, a cost model and a validator that simulates every stream
(cost, engine and checks), and timelines to look at (render). Everything else imports it;
it imports nothing of ours."""
