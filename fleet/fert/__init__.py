"""FERT, failure-guided experience retrieval fine-tuning, in one package.

After "Learning from Fleet Experience": the fleet's failures are located, similar successful experience is
retrieved from the whole fleet's store, and the shared policy is fine-tuned on it (with demonstration replay,
the success critic's distillation and a validation gate) while the fleet keeps working. The method's choices and
their measurements are in ``docs/FLEET_LEARNING.md``.

Modules, in the order a round uses them:

- ``config``: :class:`~fleet.fert.config.FertConfig`, the typed ``fert`` group (gate, retries, critic, mix,
  distillation, onset, priority), the only place its defaults live;
- ``failure``: the progress score, failure onsets (``annotate_failures`` writes them into the store), segment
  gains and progress advantages;
- ``contexts``: failure contexts (the window before each onset) and their order; ``retry_of``;
- ``keys``: the retrieval key (``RelativeEmbedder``, ``ContextEmbedder``, the AED action-history and policy
  encoders);
- ``index``: ``SuccessIndex``, the faiss index of successful windows, one per task;
- ``priority``: ``TaskPriority``, the tasks' learnability weights;
- ``retrieve``: ``retrieve`` and its result ``Retrieval``;
- ``dataset``: ``FertDataset`` / ``FertBatchSampler``, retrieved windows mixed with replay;
- ``data``: ``FertData``, the above as one object per learner;
- ``critic_fit``: fitting the success critic on the store (the critic model is ``policies.critic``);
- ``audit``: the per-round retrieval audit;
- ``gate``: the validation gate (``make_validator``) and its per-task loss rule;
- ``algorithm``: ``FertAlgorithm``, one round's learning from a given checkpoint (``update``: retrieval, the
  critic's fit beside the distillation's candidates, the round's mix, fine-tuning, the audit) into a candidate;
- ``learner_config`` / ``learner``: ``FertLearner``, which decides when a round runs and from which weights,
  gates and publishes its candidate and keeps its state.

Importing the package loads nothing: import the module you need.
"""
