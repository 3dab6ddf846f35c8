"""Node-pool providers: one narrow interface (`base.NodeGroup`, `base.CloudProvider`), one
module per cloud; the planner never knows which one it talks to."""
