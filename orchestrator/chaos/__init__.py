"""``orchestrator chaos``: a seeded, bounded fault campaign against a real cluster, and an
independent checker of what the cluster promised (see docs/chaos.md)."""

from orchestrator.chaos.campaign import CampaignConfig, Report, run_campaign
from orchestrator.chaos.cluster import Timing

__all__ = ["CampaignConfig", "Report", "Timing", "run_campaign"]
