def test_broker_serves_simulated_gpus(client):
    info = client.info()
    assert info["simulated"] is True
    gpus = client.gpus()["gpus"]
    assert len(gpus) == 4 and all(g["simulated"] and g["state"] == "free" for g in gpus)
