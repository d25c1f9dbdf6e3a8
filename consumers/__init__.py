"""The services of the drone-delivery choreography; each module reads like its business rule."""
