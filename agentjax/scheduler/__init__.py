"""The scheduler: requests, sessions and the per-step token choice. Host only: never imports jax."""
from agentjax.scheduler.request import AgentHints, Request, RequestState, Session
from agentjax.scheduler.scheduler import Scheduler, SchedulerOutput, ScheduledRequest

__all__ = ["AgentHints", "Request", "RequestState", "Scheduler", "ScheduledRequest", "SchedulerOutput", "Session"]
