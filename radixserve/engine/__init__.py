"""The batching engine: requests, scheduler, policies, the offline Engine API."""
