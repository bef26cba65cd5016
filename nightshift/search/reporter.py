"""The trainer's per-epoch hook for a search trial: report the objective, ask whether to prune.

Rank 0 of the trainer calls it after every epoch (`Trainer(on_epoch=...)`). It records the epoch's
metrics on the trial (user attribute `nightshift.epoch.NNNN`, for the MLflow child run), reports the
search's objective (`val_accuracy`, or `val_rmse` for a regression) as the intermediate value at step =
epoch, and asks the study's pruner whether to stop; ASHA answers only at its rungs (min_epochs x
reduction_factor^k epochs), so asking every epoch asks at every rung. A prune is recorded
(`nightshift.pruned_at_epoch`) for whoever tells the study the outcome; the trial itself stays RUNNING until
then. Never asked at the last epoch: the trial is complete.

In a separate process (a trial under horovodrun or an MPIJob) the hook opens the study by name from the
storage (`TrainConfig.search_*`); the CLI's in-process trials hand it their `optuna.Trial`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from nightshift.search.errors import TrialNotRunning
from nightshift.search.study import EPOCH_ATTR, PRUNED_ATTR

if TYPE_CHECKING:
    import optuna

    from nightshift.train.config import TrainConfig


class TrialReporter:
    """`on_epoch` for the trainer, reporting to one RUNNING trial."""

    def __init__(self, trial: optuna.Trial, max_epochs: int, objective: str = "val_accuracy") -> None:
        self.trial = trial
        self.max_epochs = max_epochs
        self.objective = objective  # the search's (SearchSettings.objective)

    @classmethod
    def for_config(cls, config: TrainConfig) -> _LazyReporter:
        """The hook a trainer process builds from `--search-storage/--search-study/--search-trial`; it
        connects on its first call, so only rank 0 (the one that calls it) opens the database."""
        assert config.search_storage and config.search_study and config.search_trial is not None
        return _LazyReporter(config.search_storage, config.search_study, config.search_trial, config.epochs)

    def __call__(self, epoch: int, metrics: dict[str, float]) -> bool:
        if self.objective not in metrics:
            raise ValueError(f"epoch {epoch} has no {self.objective} to report (metrics: {sorted(metrics)}): "
                             f"does the trainer train the search's task?")
        self.trial.set_user_attr(f"{EPOCH_ATTR}{epoch:04d}", {k: float(v) for k, v in metrics.items()})
        self.trial.report(float(metrics[self.objective]), step=epoch)
        if epoch >= self.max_epochs or not self.trial.should_prune():
            return False
        self.trial.set_user_attr(PRUNED_ATTR, epoch)
        return True


class _LazyReporter:
    def __init__(self, storage: str, study: str, number: int, epochs: int) -> None:
        self.storage, self.study, self.number, self.epochs = storage, study, number, epochs
        self._reporter: TrialReporter | None = None

    def connect(self) -> TrialReporter:
        import optuna

        from nightshift.search.study import load_study

        study, settings = load_study(self.storage, self.study)
        where = f"trial {self.number} of study {self.study!r}"
        if self.epochs != settings.max_epochs:
            raise TrialNotRunning(f"{where} trains for {settings.max_epochs} epochs (the search's max_epochs); "
                                  f"this trainer was started with --epochs {self.epochs}")
        try:
            trial_id = study._storage.get_trial_id_from_study_id_trial_number(study._study_id, self.number)
        except KeyError as err:
            raise TrialNotRunning(f"{where} does not exist in {self.storage}") from err
        state = study._storage.get_trial(trial_id).state
        if state != optuna.trial.TrialState.RUNNING:
            raise TrialNotRunning(f"{where} is {state.name}, not RUNNING: ask the study for a new trial")
        return TrialReporter(optuna.trial.Trial(study, trial_id), settings.max_epochs, settings.objective)

    def __call__(self, epoch: int, metrics: dict[str, Any]) -> bool:
        if self._reporter is None:
            self._reporter = self.connect()
        return self._reporter(epoch, metrics)
